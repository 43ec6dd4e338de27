#!/usr/bin/env bash
# Train on Kaggle with configs/kaggle.yaml (outputs under /kaggle/working). From a notebook cell:
#
#   !bash scripts/run_kaggle.sh [--field value ...]      # extra arguments go to train.py
#
# Accelerator "GPU T4 x2" gives two processes (fp16, NCCL without peer-to-peer); the P100 is refused:
# current PyTorch CUDA wheels have no kernels for it. Kaggle's internet is often off: nothing is
# installed when every dependency is already there (true for the default example), and SKIP_INSTALL=1
# never tries. A stop (interrupt) saves a checkpoint (train.py exits 75); running again continues.
# It refuses to run outside Kaggle (ANY_PLATFORM=1 overrides). notebooks/kaggle.ipynb has the cells.
# What it decides, why, and the variables that change it: src/{{ cookiecutter.package_name }}/launch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHON PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m "{{ cookiecutter.package_name }}.launch" kaggle "$@"
