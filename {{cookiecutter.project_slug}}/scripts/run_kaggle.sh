#!/usr/bin/env bash
# Train on Kaggle with configs/kaggle.yaml (outputs under /kaggle/working). From a notebook cell:
#
#   !bash scripts/run_kaggle.sh [--field value ...]      # extra arguments go to train.py
#
# Accelerator "GPU T4 x2" gives two processes (fp16, NCCL without peer-to-peer); the P100 is refused:
# current PyTorch CUDA wheels have no kernels for it. Kaggle's internet is often off: nothing is
# installed when every dependency is already there (true for the default example), and SKIP_INSTALL=1
# never tries. A stop (interrupt) saves a checkpoint (train.py exits 75); running again continues.
# notebooks/kaggle.ipynb has the cells. What it decides and how: scripts/_common.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=_common.sh
. scripts/_common.sh

UNSUPPORTED_GPU_HINT="In the notebook: Settings > Accelerator > GPU T4 x2."

# Called by run_platform for multi-GPU runs: NCCL's peer-to-peer transport hangs between Kaggle's two
# T4s, so it is turned off (traffic goes through host memory; slower, never stuck). Your own
# NCCL_P2P_DISABLE wins.
configure_nccl() {
  export NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE:-1}
  say "NCCL: NCCL_P2P_DISABLE=$NCCL_P2P_DISABLE (P2P between Kaggle's T4s can hang)"
}

run_platform kaggle "$@"
