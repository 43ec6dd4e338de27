#!/usr/bin/env bash
# Train on this machine (laptop, workstation) with configs/local.yaml: every visible GPU, or the CPU.
#
#   scripts/run_local.sh [--field value ...]       # extra arguments go to train.py and win
#   NUM_PROCESSES=2 scripts/run_local.sh           # 2 CPU processes that really talk (gloo)
#   SKIP_INSTALL=1 scripts/run_local.sh            # never run pip
#
# Stop with Ctrl-C: a checkpoint is saved (exit 75); the same command continues from it.
# What it decides, why, and the variables that change it: src/{{ cookiecutter.package_name }}/launch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHON PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m "{{ cookiecutter.package_name }}.launch" local "$@"
