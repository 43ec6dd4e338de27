#!/usr/bin/env bash
# A small sweep: one training run per value of one config field, one after the other, each in its own
# output_dir (SWEEP_DIR/<field>=<value>), each started by scripts/run_local.sh.
#
#   scripts/sweep.sh learning_rate 1e-3 3e-3 1e-2         # -> outputs/{{ cookiecutter.task }}-sweep/learning_rate=1e-3, ...
#   scripts/sweep.sh seed 1 2 3 -- --num_epochs 5         # after --: arguments for every run
#   SWEEP_DIR=outputs/lr-sweep scripts/sweep.sh learning_rate 1e-3 3e-3
#
# Every run resumes like any other: after a stop (Ctrl-C saves a checkpoint and exits 75) or a crash, the
# same command continues the sweep. A run that finished with the same arguments and configs/local.yaml
# is skipped without starting Python (its folder's sweep.done says how it ran; delete it to run it again),
# the stopped one continues from its checkpoint, the rest start. The first run that does not finish stops
# the sweep, with its exit status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ $# -lt 2 || $1 == -* ]]; then
  echo "usage: scripts/sweep.sh <config field> <value> [<value> ...] [-- <arguments for every run>]" >&2
  exit 2
fi
field=$1
shift
values=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  if [[ $1 == */* || $1 == "" ]]; then
    echo "error: sweep value '$1' would not make a folder name: use values without '/'" >&2
    exit 2
  fi
  values+=("$1")
  shift
done
[[ $# -gt 0 ]] && shift # the --
default_dir="outputs/{{ cookiecutter.task }}-sweep"
sweep_dir=${SWEEP_DIR:-$default_dir}

for value in "${values[@]}"; do
  run="$sweep_dir/$field=$value"
  how="arguments: --$field $value $* | configs/local.yaml: $(cksum <configs/local.yaml)"
  if [[ -f $run/model/export.json && -f $run/sweep.done && $(<"$run/sweep.done") == "$how" ]]; then
    echo "sweep: $field=$value finished earlier, skipped (delete $run/sweep.done to run it again)"
    continue
  fi
  echo "sweep: $field=$value -> $run"
  scripts/run_local.sh --output_dir "$run" "--$field" "$value" "$@"
  echo "$how" >"$run/sweep.done"
done

echo "sweep: done. Each run's export.json (step and last evaluation):"
for value in "${values[@]}"; do
  echo "  $field=$value: $(tr -d '\n' <"$sweep_dir/$field=$value/model/export.json" | tr -s ' ')"
done
if [[ -d "$sweep_dir/$field=${values[0]}/logs" ]]; then # TensorBoard's folder (tracker: tensorboard)
  echo "Compare them: tensorboard --logdir $sweep_dir"
fi
