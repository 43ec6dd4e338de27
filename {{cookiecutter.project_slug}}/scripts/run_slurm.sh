#!/usr/bin/env bash
# Train on a SLURM cluster with configs/slurm.yaml: one node or several, requeued before the time limit.
#
#   sbatch --gpus-per-node=4 --cpus-per-task=32 scripts/run_slurm.sh [--field value ...]   # your requests
#   sbatch --nodes=2 --ntasks-per-node=2 scripts/run_slurm.sh   # CPU nodes: 2 processes per node (gloo)
#
# Processes per node: NUM_PROCESSES, else --ntasks-per-node (or --ntasks), else one per GPU, else 1.
# On one node with one process training runs as `srun python train.py`; otherwise one srun task per
# node runs `accelerate launch` with its machine rank, the head node's address and a free port.
#
# Time limits: --signal=B:USR1@300 sends SIGUSR1 to the batch process (the launcher) 300 s before the
# limit; it passes it to the srun step, train.py saves a checkpoint and exits 75, and the launcher
# requeues the job (--requeue allows it), which continues from that checkpoint. So does any other stop
# that ends in a checkpoint (scontrol requeue, scancel --signal=USR1 to the step). A requeued run that
# made no progress is not requeued again (a --time shorter than the warning would loop forever).
#
#SBATCH --job-name=train
#SBATCH --nodes=1
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
# A requeued job appends to the same log instead of overwriting it.
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# Most clusters also want an account and a partition:
##SBATCH --account=your-account
##SBATCH --partition=gpu
#
# What it decides, why, and the variables that change it: src/{{ cookiecutter.package_name }}/launch.py
# (PROJECT_DIR if sbatch was run from elsewhere than the project).
set -euo pipefail

# sbatch runs a copy of this file from a spool directory, so its own location says nothing: look in
# PROJECT_DIR, next to this file (when run with bash directly), then in the directory sbatch ran from.
for candidate in "${PROJECT_DIR:-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR:-}"; do
  if [ -n "$candidate" ] && [ -f "$candidate/train.py" ] && [ -f "$candidate/scripts/run_slurm.sh" ]; then
    cd "$candidate"
    PYTHON=${PYTHON:-$(command -v python || command -v python3)}
    export PYTHON PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    exec "$PYTHON" -m "{{ cookiecutter.package_name }}.launch" slurm "$@"
  fi
done
echo "run_slurm: ERROR: project not found: run sbatch from the project root or set PROJECT_DIR" >&2
exit 1
