#!/usr/bin/env bash
# Train on this machine with configs/local.yaml, using every visible GPU, or the CPU.
#
#   scripts/run_local.sh [--field value ...]        # extra arguments go to train.py
#   NUM_PROCESSES=2 scripts/run_local.sh            # 2 CPU processes that talk over gloo
set -euo pipefail
cd "$(dirname "$0")/.."

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c . || true)
fi
processes=${NUM_PROCESSES:-$((gpus > 0 ? gpus : 1))}
args=(train.py --config configs/local.yaml "$@")

if [ "$processes" -le 1 ]; then
  echo "run_local: $gpus GPU(s) visible, 1 process"
  exec python "${args[@]}"
fi
if [ "$gpus" -eq 0 ]; then
  # Without ACCELERATE_USE_CPU, --multi_gpu on a CPU-only machine starts independent copies that
  # never communicate; with it, the processes form one gloo group.
  echo "run_local: no GPU, $processes CPU processes on gloo"
  export ACCELERATE_USE_CPU=1
else
  echo "run_local: $gpus GPU(s) visible, $processes processes"
fi
# train.py picks the precision itself (config mixed_precision, "auto" by default); the flag only
# keeps accelerate from warning about a missing default.
exec accelerate launch --multi_gpu --num_machines 1 --num_processes "$processes" \
  --mixed_precision no --dynamo_backend no "${args[@]}"
