#!/usr/bin/env bash
# Train on a SLURM cluster with configs/slurm.yaml: one node or several, requeued before the time limit.
#
#   sbatch scripts/run_slurm.sh [--field value ...]                  # from the project root
#   sbatch --nodes=2 --gpus-per-node=4 scripts/run_slurm.sh           # sbatch's flags win over the lines below
#
# One task per node runs `accelerate launch`, which starts one process per GPU of its node (on one
# node with one GPU: `python train.py`, no launcher). The GPUs of the node running this script decide
# the processes per node and the precision: give every node the same GPUs.
#
# Time limits: --signal=B:USR1@300 sends SIGUSR1 to THIS batch shell 300 s before the limit. B: because
# the batch shell is the one process that can requeue the job; without B:, SLURM signals the job steps
# only and the shell never knows. The shell forwards the signal to srun, srun to each node's launcher,
# the launcher to every training process (PET_SIGNALS_TO_HANDLE). train.py then stops all processes at
# the same step, saves a checkpoint and exits 75; this script requeues the job (--requeue allows it)
# and the requeued job continues from that checkpoint. Resubmitting by hand continues the same way.
# (SLURM may send the signal up to 60 s late; 300 s leaves time for the next log step and a checkpoint.)
#
#SBATCH --job-name=train
#SBATCH --nodes=1
# One task per node: accelerate launch starts the per-GPU processes itself.
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
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
# Environment: see scripts/_common.sh (NUM_PROCESSES is per node here; MAIN_PROCESS_PORT defaults to
# 29500; PROJECT_DIR if sbatch was run from elsewhere than the project).
set -euo pipefail

# sbatch runs a copy of this file from a spool directory, so its own location says nothing: look in
# PROJECT_DIR, next to this file (when run with bash directly), then in the directory sbatch ran from.
found=""
for candidate in "${PROJECT_DIR:-}" "$(dirname "${BASH_SOURCE[0]}")/.." "${SLURM_SUBMIT_DIR:-}" \
  "${SLURM_SUBMIT_DIR:-.}/.."; do
  if [ -n "$candidate" ] && [ -f "$candidate/train.py" ] && [ -f "$candidate/scripts/_common.sh" ]; then
    found=$candidate
    break
  fi
done
if [ -z "$found" ]; then
  echo "run_slurm: ERROR: project not found: run sbatch from the project root or set PROJECT_DIR" >&2
  exit 1
fi
cd "$found"
# shellcheck source=_common.sh
. scripts/_common.sh

# SIGUSR1 from SLURM (see above), at any point of this script.
stop_requested=0
step_pid=""
wait_interrupted=0
# shellcheck disable=SC2329  # called by the trap below
on_usr1() {
  stop_requested=1
  wait_interrupted=1
  say "SIGUSR1: the time limit is near, asking training to save a checkpoint and stop"
  if [ -n "$step_pid" ]; then
    kill -USR1 "$step_pid" 2>/dev/null || true
  fi
}
trap on_usr1 USR1

requeue() {
  say "requeue: $1; scontrol requeue $SLURM_JOB_ID (the requeued job continues from the checkpoint)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}

launcher_setup slurm
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM job: submit it with sbatch scripts/run_slurm.sh"
nodes=${SLURM_NNODES:-1}
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "SLURM_NNODES='$nodes' is not a node count"

detect_gpus
UNSUPPORTED_GPU_HINT="Ask for another GPU type (e.g. sbatch --gpus-per-node=a100:1 or --constraint)."
refuse_unsupported_gpus
choose_processes
total=$((PROCESSES * nodes))
say "nodes: $nodes ($PROCESSES process(es) per node, $total in total)"
choose_precision "$@"
if [ "$total" -gt 1 ] && [ "$GPU_COUNT" -gt 0 ]; then
  say "NCCL: library defaults (set NCCL_SOCKET_IFNAME if the nodes have several networks)"
else
  say "NCCL: not used (a single process, or CPU processes on gloo)"
fi
build_train_args "$@"
install_missing
if [ "$stop_requested" = 1 ]; then
  requeue "SIGUSR1 arrived before training started"
fi

if [ "$total" -eq 1 ]; then
  # One process: srun runs train.py itself, which receives the forwarded SIGUSR1 directly.
  step=(srun --nodes=1 --ntasks=1 "$PYTHON" "${TRAIN_ARGS[@]}")
else
  HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
  [ -n "$HEAD" ] || die "no head node in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
  MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
  TOTAL_PROCESSES=$total
  export HEAD MAIN_PROCESS_PORT TOTAL_PROCESSES PRECISION
  export PET_SIGNALS_TO_HANDLE=$FORWARDED_SIGNALS
  # After forwarding a signal the launcher SIGKILLs workers that are still running 30 s later (torch's
  # default); 120 s leaves a large model time to write its checkpoint.
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
  if [ "$GPU_COUNT" -eq 0 ]; then
    export ACCELERATE_USE_CPU=1 # CPU nodes: one gloo group (plain --multi_gpu would not communicate)
  fi
  say "distributed: head node $HEAD:$MAIN_PROCESS_PORT, $total processes on $nodes node(s)"
  # Single quotes on purpose: $SLURM_NODEID (and the rest) expand on each node, in its own task.
  # shellcheck disable=SC2016
  step=(srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c
    'exec accelerate launch --multi_gpu --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
      --main_process_ip "$HEAD" --main_process_port "$MAIN_PROCESS_PORT" --num_processes "$TOTAL_PROCESSES" \
      --mixed_precision "$PRECISION" --dynamo_backend no "$@"'
    bash "${TRAIN_ARGS[@]}")
fi
print_command "${step[@]}"

# In the background, so that the USR1 trap runs while training does (bash runs traps only between
# commands, and `wait` is interruptible, a foreground command is not).
"${step[@]}" &
step_pid=$!
while :; do
  wait_interrupted=0
  status=0
  wait "$step_pid" || status=$?
  [ "$wait_interrupted" = 1 ] || break
done

if [ "$stop_requested" = 1 ] && [ "$status" -ne 0 ]; then
  # 75 from train.py itself; a multi-process launcher reports its forwarded signal as a failure even
  # when every worker saved and exited cleanly. Either way the newest complete checkpoint is there.
  requeue "training stopped after SIGUSR1 (exit $status)"
fi
if [ "$status" -eq 0 ]; then
  say "done: training finished"
else
  say "training failed (exit $status): not requeued"
fi
exit "$status"
