#!/usr/bin/env bash
# Shared by scripts/run_*.sh: sourced from the project root, never run on its own.
#
# Every launcher takes the same steps and prints one line per decision:
#   1. GPUs: `nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader` is the only
#      source of device facts (train.py reads the same query), limited to CUDA_VISIBLE_DEVICES when
#      that lists indices. No nvidia-smi, or one that fails: a CPU-only machine.
#   2. Refuse GPUs that current PyTorch CUDA wheels cannot run (compute capability below 7.0, e.g. the
#      Tesla P100), before anything is installed or started.
#   3. Processes: one per visible GPU, 1 without a GPU; NUM_PROCESSES overrides.
#   4. Precision: bf16 when every GPU has compute capability >= 8.0 (A100, L4, H100, RTX 30xx+),
#      fp16 below (T4, V100: bf16 would be emulated and slow), `no` on the CPU.
#   5. Install what pyproject.toml lists but is missing, never replacing the installed torch.
# Then training starts. One process: `python train.py ...`, so that signals (Ctrl-C, SIGTERM, SIGUSR1)
# reach train.py directly. Several: `accelerate launch --multi_gpu ...` with PET_SIGNALS_TO_HANDLE, so
# the launcher forwards SIGUSR1 to the workers instead of dying on it.
# train.py gets `--config configs/<platform>.yaml --mixed_precision <choice>` BEFORE your own arguments:
# train.py takes the last occurrence of a flag, so `--mixed_precision fp16` or `--config x.yaml` of yours
# wins. After a signal train.py saves a checkpoint and exits 75; running the same command again continues
# from it.
#
# Environment variables:
#   NUM_PROCESSES=N         N processes instead of one per GPU (on SLURM: per node)
#   SKIP_INSTALL=1          never run pip (dependencies already installed, or no internet)
#   PYTHON=python3.12       the interpreter (default: python, else python3)
#   MAIN_PROCESS_PORT=P     rendezvous port (default: accelerate's 29500; on SLURM 29500)
#   MIN_COMPUTE_CAPABILITY  the oldest GPU accepted (default 7.0; lower it only for a torch build that
#                           still ships kernels for older GPUs)
# Note: this file is copied into new projects without Jinja rendering; it must never contain a brace
# followed by another brace, a percent sign or a hash (so no bash string-length expansions).

if ! (return 0 2>/dev/null); then
  echo "scripts/_common.sh is sourced by scripts/run_*.sh; run one of those instead" >&2
  exit 1
fi

# Signals the multi-process launcher forwards to its workers instead of dying (SIGUSR1: SLURM's warning).
readonly FORWARDED_SIGNALS=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1

PLATFORM=local
LAUNCHER=run_local
PYTHON=${PYTHON:-}
GPU_COUNT=0
GPU_NAMES=()
GPU_CAPABILITIES=()
GPU_MEMORY=()
PROCESSES=1
PRECISION=no
HARDWARE_PRECISION=no
CONFIG=configs/local.yaml
TRAIN_ARGS=()

say() { printf '%s: %s\n' "$LAUNCHER" "$*"; }

die() {
  printf '%s: ERROR: %s\n' "$LAUNCHER" "$*" >&2
  exit 1
}

trim() {
  local text=$1
  text=${text#"${text%%[![:space:]]*}"}
  printf '%s' "${text%"${text##*[![:space:]]}"}"
}

# launcher_setup PLATFORM: names used in messages, the interpreter, and the project's src/ importable
# without an installation (Kaggle with internet off, SKIP_INSTALL=1).
launcher_setup() {
  PLATFORM=$1
  LAUNCHER=run_$1
  CONFIG=configs/$1.yaml
  if [ -z "$PYTHON" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
  fi
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  say "platform: $PLATFORM (project $PWD)"
}

# capability_value 7.5 -> 75, 12.0 -> 120; dies on anything else.
capability_value() {
  [[ $1 =~ ^([0-9]+)\.([0-9])$ ]] || die "cannot read the compute capability '$1' reported by nvidia-smi"
  printf '%s' "$((BASH_REMATCH[1] * 10 + BASH_REMATCH[2]))"
}

# detect_gpus: fills GPU_COUNT, GPU_NAMES, GPU_CAPABILITIES, GPU_MEMORY.
detect_gpus() {
  GPU_COUNT=0
  GPU_NAMES=()
  GPU_CAPABILITIES=()
  GPU_MEMORY=()
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    say "GPUs: none (no nvidia-smi): CPU only"
    return 0
  fi
  local output
  if ! output=$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader 2>&1); then
    say "GPUs: none (nvidia-smi failed: $(trim "$output")): CPU only"
    return 0
  fi
  local names=() capabilities=() memory=() name capability total
  while IFS=, read -r name capability total; do
    name=$(trim "$name")
    [ -n "$name" ] || continue
    names+=("$name")
    capabilities+=("$(trim "$capability")")
    memory+=("$(trim "$total")")
  done <<<"$output"
  local indices=() index
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ] && [[ $CUDA_VISIBLE_DEVICES =~ ^[0-9,[:space:]]*$ ]]; then
    IFS=, read -ra indices <<<"$CUDA_VISIBLE_DEVICES"
  else
    # Unset, or GPU UUIDs (which nvidia-smi does not list here): every GPU nvidia-smi reports.
    for index in "${!names[@]}"; do indices+=("$index"); done
  fi
  for index in "${indices[@]}"; do
    index=$(trim "$index")
    if [ -n "$index" ] && [ -n "${names[index]+set}" ]; then
      GPU_NAMES+=("${names[index]}")
      GPU_CAPABILITIES+=("${capabilities[index]}")
      GPU_MEMORY+=("${memory[index]}")
      GPU_COUNT=$((GPU_COUNT + 1))
    fi
  done
  if [ "$GPU_COUNT" -eq 0 ]; then
    say "GPUs: none visible (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}'): CPU only"
    return 0
  fi
  local listed=() i
  for i in "${!GPU_NAMES[@]}"; do
    listed+=("${GPU_NAMES[i]} (compute ${GPU_CAPABILITIES[i]}, ${GPU_MEMORY[i]})")
  done
  local joined
  joined=$(printf '%s, ' "${listed[@]}")
  say "GPUs: $GPU_COUNT x ${joined%, }"
}

# refuse_unsupported_gpus: exit non-zero, before installing or launching, on a GPU torch cannot use.
refuse_unsupported_gpus() {
  local minimum=${MIN_COMPUTE_CAPABILITY:-7.0} i
  for i in "${!GPU_NAMES[@]}"; do
    if [ "$(capability_value "${GPU_CAPABILITIES[i]}")" -lt "$(capability_value "$minimum")" ]; then
      die "${GPU_NAMES[i]} has compute capability ${GPU_CAPABILITIES[i]}; current PyTorch CUDA wheels" \
        "need $minimum or newer, so training would fail with 'no kernel image is available'." \
        "${UNSUPPORTED_GPU_HINT:-Use a newer GPU.}"
    fi
  done
}

# choose_processes: PROCESSES from NUM_PROCESSES, else one per GPU, else 1.
choose_processes() {
  if [ -n "${NUM_PROCESSES:-}" ]; then
    [[ $NUM_PROCESSES =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES must be a positive integer, not '$NUM_PROCESSES'"
    if [ "$GPU_COUNT" -gt 0 ] && [ "$NUM_PROCESSES" -gt "$GPU_COUNT" ]; then
      die "NUM_PROCESSES=$NUM_PROCESSES but only $GPU_COUNT GPU(s) are visible: one process per GPU at most"
    fi
    PROCESSES=$NUM_PROCESSES
    say "processes: $PROCESSES (NUM_PROCESSES)"
  elif [ "$GPU_COUNT" -gt 0 ]; then
    PROCESSES=$GPU_COUNT
    say "processes: $PROCESSES (one per GPU)"
  else
    PROCESSES=1
    say "processes: 1 (CPU only; NUM_PROCESSES=2 starts 2 CPU processes that talk over gloo)"
  fi
}

# last_flag_value FLAG ARGS...: the value of the last `FLAG value` or `FLAG=value` in ARGS, else nothing.
last_flag_value() {
  local flag=$1 found=""
  shift
  while [ "$#" -gt 0 ]; do
    case $1 in
      "$flag")
        if [ "$#" -gt 1 ]; then
          found=$2
          shift
        fi
        ;;
      "$flag"=*) found=${1#*=} ;;
    esac
    shift
  done
  printf '%s' "$found"
}

# choose_precision ARGS...: HARDWARE_PRECISION from the GPUs; PRECISION (accelerate's flag) is the same
# unless the user's arguments set --mixed_precision, which train.py will then use too.
choose_precision() {
  local reason i low=""
  if [ "$GPU_COUNT" -eq 0 ]; then
    PRECISION=no
    reason="no GPU; fp16 on the CPU would silently run in fp32"
  else
    for i in "${!GPU_NAMES[@]}"; do
      if [ "$(capability_value "${GPU_CAPABILITIES[i]}")" -lt 80 ]; then
        low="${GPU_NAMES[i]} (compute ${GPU_CAPABILITIES[i]})"
      fi
    done
    if [ -n "$low" ]; then
      PRECISION=fp16
      reason="$low is below compute capability 8.0, where bf16 is only emulated"
    else
      PRECISION=bf16
      reason="every GPU has compute capability >= 8.0"
    fi
  fi
  HARDWARE_PRECISION=$PRECISION
  local chosen
  chosen=$(last_flag_value --mixed_precision "$@")
  if [ -n "$chosen" ]; then
    say "precision: $chosen (your --mixed_precision; the hardware suggests $PRECISION: $reason)"
    PRECISION=$chosen
  else
    say "precision: $PRECISION ($reason)"
  fi
}

# build_train_args ARGS...: TRAIN_ARGS = train.py, the platform's config and precision, then ARGS.
build_train_args() {
  local chosen
  chosen=$(last_flag_value --config "$@")
  if [ -n "$chosen" ]; then
    say "config: $chosen (your --config, instead of $CONFIG)"
  else
    say "config: $CONFIG"
  fi
  TRAIN_ARGS=(train.py --config "$CONFIG" --mixed_precision "$HARDWARE_PRECISION" "$@")
}

# The names of pyproject.toml's dependencies that are not installed, or installed in a version outside
# the requirement; one per line. Reads metadata only: nothing is imported, no CUDA is initialized.
readonly MISSING_DEPENDENCIES_PY='
import re
from importlib import metadata

text = open("pyproject.toml", encoding="utf-8").read()
try:
    import tomllib

    requirements = tomllib.loads(text)["project"]["dependencies"]
except ModuleNotFoundError:  # Python 3.10: the dependencies array is one plain list of strings
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    requirements = re.findall(r"\"([^\"]+)\"", block.group(1))
for requirement in requirements:
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(requirement)
        continue
    try:
        from packaging.requirements import Requirement
    except ImportError:  # without packaging, being installed is enough
        continue
    if not Requirement(requirement).specifier.contains(installed, prereleases=True):
        print(requirement + " (installed: " + installed + ")")
'

# install_missing: `pip install -e .` when a dependency is missing, with the installed torch pinned by a
# constraint file, so pip never swaps Colab's or Kaggle's CUDA build of torch for another one.
install_missing() {
  if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    say "install: skipped (SKIP_INSTALL=1)"
    return 0
  fi
  local missing
  missing=$("$PYTHON" -c "$MISSING_DEPENDENCIES_PY") || die "could not check the installed packages with $PYTHON"
  if [ -z "$missing" ]; then
    say "install: nothing to do (every dependency of pyproject.toml is installed)"
    return 0
  fi
  local constraints torch_version
  constraints=$(mktemp)
  torch_version=$("$PYTHON" -c 'from importlib import metadata; print(metadata.version("torch"))' 2>/dev/null) ||
    torch_version=""
  say "install: missing ${missing//$'\n'/; }"
  if [ -n "$torch_version" ]; then
    printf 'torch==%s\n' "$torch_version" >"$constraints"
    say "install: pip install -e . --constraint <torch==$torch_version>: the installed torch stays"
  else
    say "install: torch is not installed, so pip installs its default build (install the torch build" \
      "you want first to choose it)"
  fi
  if ! "$PYTHON" -m pip install -e . --constraint "$constraints"; then
    rm -f "$constraints"
    die "pip install failed. Without internet (Kaggle: Settings > Internet), install the packages" \
      "another way and rerun with SKIP_INSTALL=1."
  fi
  rm -f "$constraints"
}

# print_command ARGS...: the command about to start, quoted so that it can be copied into a shell.
print_command() {
  local quoted
  quoted=$(printf '%q ' "$@")
  say "launch: ${quoted% }"
}

# launch_one_machine: start training on this machine; never returns.
launch_one_machine() {
  if [ "$PROCESSES" -eq 1 ]; then
    # One process: no launcher in between, train.py receives every signal itself.
    print_command "$PYTHON" "${TRAIN_ARGS[@]}"
    exec "$PYTHON" "${TRAIN_ARGS[@]}"
  fi
  export PET_SIGNALS_TO_HANDLE=$FORWARDED_SIGNALS
  local launch=(accelerate launch --multi_gpu --num_processes "$PROCESSES" --num_machines 1)
  if [ -n "${MAIN_PROCESS_PORT:-}" ]; then
    launch+=(--main_process_port "$MAIN_PROCESS_PORT")
  fi
  launch+=(--mixed_precision "$PRECISION" --dynamo_backend no)
  if [ "$GPU_COUNT" -eq 0 ]; then
    # Plain --multi_gpu on a CPU-only machine starts independent copies that never communicate;
    # ACCELERATE_USE_CPU=1 makes them one gloo process group.
    export ACCELERATE_USE_CPU=1
    say "distributed: $PROCESSES CPU processes on gloo (ACCELERATE_USE_CPU=1)"
  else
    say "distributed: $PROCESSES GPU processes on NCCL"
  fi
  print_command "${launch[@]}" "${TRAIN_ARGS[@]}"
  exec "${launch[@]}" "${TRAIN_ARGS[@]}"
}

# run_platform PLATFORM ARGS...: the whole sequence for one machine (Colab, Kaggle, laptop).
# A launcher may set UNSUPPORTED_GPU_HINT and define configure_nccl (called for multi-GPU runs only).
run_platform() {
  launcher_setup "$1"
  shift
  detect_gpus
  refuse_unsupported_gpus
  choose_processes
  choose_precision "$@"
  if [ "$PROCESSES" -eq 1 ] || [ "$GPU_COUNT" -eq 0 ]; then
    say "NCCL: not used (a single process, or CPU processes on gloo)"
  elif declare -F configure_nccl >/dev/null; then
    configure_nccl
  else
    say "NCCL: library defaults"
  fi
  build_train_args "$@"
  install_missing
  launch_one_machine
}
