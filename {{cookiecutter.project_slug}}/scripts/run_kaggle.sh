#!/usr/bin/env bash
# Train on Kaggle with configs/kaggle.yaml (outputs under /kaggle/working). From a notebook cell, with the
# project's src/ on sys.path:
#
#   from {{ cookiecutter.package_name }}.notebook import run_training
#   run_training("kaggle", "--field", "value")   # runs this script; extra arguments go to train.py
#
# run_training, not `!bash scripts/run_kaggle.sh`: Jupyter kills a `!` command 0.2 s after an interrupt,
# before training can save its checkpoint (see src/{{ cookiecutter.package_name }}/notebook.py).
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
