#!/usr/bin/env bash
# Train on this machine (laptop, workstation) with configs/local.yaml: every visible GPU, or the CPU.
#
#   scripts/run_local.sh [--field value ...]       # extra arguments go to train.py and win
#   NUM_PROCESSES=2 scripts/run_local.sh           # 2 CPU processes that really talk (gloo)
#   SKIP_INSTALL=1 scripts/run_local.sh            # never run pip
#
# Stop with Ctrl-C: a checkpoint is saved (exit 75); the same command continues from it.
# What it decides and how: scripts/_common.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=_common.sh
. scripts/_common.sh

UNSUPPORTED_GPU_HINT="Run on the CPU instead: CUDA_VISIBLE_DEVICES= scripts/run_local.sh"
run_platform local "$@"
