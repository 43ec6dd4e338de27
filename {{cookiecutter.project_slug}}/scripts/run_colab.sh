#!/usr/bin/env bash
# Train on Google Colab with configs/colab.yaml (the session's disk, copied to Google Drive in the
# background). From notebook cells:
#
#   from google.colab import drive; drive.mount("/content/drive")   # first: mirror_dir is on Drive
#   from {{ cookiecutter.package_name }}.notebook import run_training   # with the project's src/ on sys.path
#   run_training("colab", "--field", "value")   # runs this script; extra arguments go to train.py
#
# run_training, not `!bash scripts/run_colab.sh`: Colab's `!` passes a first interrupt on as SIGINT, but a
# second kills training 0.5 s later, mid-checkpoint; run_training waits for the checkpoint (see
# src/{{ cookiecutter.package_name }}/notebook.py).
# Colab's torch is kept: only missing packages are installed, with the installed torch pinned.
# The session can die at any time: run the same cell again in a new session and training continues
# from the newest checkpoint on Drive that verifies (interrupting the cell saves one first, and
# completes the copy to Drive; train.py then exits 75).
# It refuses to run outside Colab (ANY_PLATFORM=1 overrides). notebooks/colab.ipynb has the cells.
# What it decides, why, and the variables that change it: src/{{ cookiecutter.package_name }}/launch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHON PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m "{{ cookiecutter.package_name }}.launch" colab "$@"
