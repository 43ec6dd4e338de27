#!/usr/bin/env bash
# The GPU checks of a round in which a GPU is lent, in one go (at most about 8 minutes on one GPU), ending
# with one table: part | result | figures. Paste that table in the round's closing note.
#
#     bash bench/gpu.sh            # on the GPU machine, from the template repository's root
#     bash bench/gpu.sh --dry-run  # what it would run, with the time each part gets; runs nothing
#
# Needs no network: python (PYTHON, else python3) with torch built for CUDA, accelerate, pytest and the
# project's requirements; cookiecutter to render, or GPU_SH_WHEELS, a folder of wheels it installs with
# pip --no-index (cookiecutter and its dependencies: binaryornot, chardet, python-slugify,
# text-unidecode, arrow, tzdata, jinja2, click, pyyaml, requests, rich). It renders the digits and lm
# projects, runs `pytest -m cuda` in both (three suites side by side: they check, they do not time), then,
# alone on the GPU, the GPU modes of bench/bench.py and bench/checkpoints.py, bench/time_lost.py (SIGKILLs
# against max_time_lost, fewer kills than on a CPU) and, where the file exists, `bench/nanogpt.py --quick`. Each part has its own time limit; every log is kept in LOGS (under $OUT
# when that is set, else a new temporary folder).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
DRY=false
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=true
elif [[ $# -gt 0 ]]; then
    echo "gpu.sh: unknown argument $1 (only --dry-run)" >&2
    exit 2
fi

# Seconds per part: the three suites run side by side, then the benchmarks one after another.
SUITE_S=250
BENCH_S=110
CHECKPOINTS_S=70
TIME_LOST_S=150
NANOGPT_S=30

declare -a PARTS=() RESULTS=() FIGURES=()
record() { PARTS+=("$1"); RESULTS+=("$2"); FIGURES+=("$3"); }

# `result STATUS LIMIT`: passed, failed (status), or timed out.
result() {
    case "$1" in
        0) echo "passed" ;;
        124 | 137) echo "timed out after $2 s" ;;
        *) echo "failed ($1)" ;;
    esac
}

plan() {
    echo "render: cookiecutter task=digits and task=lm into a temporary folder"
    echo "pytest -m cuda, side by side, ${SUITE_S} s each: digits tests/test_cuda.py; digits the rest;" \
        "lm all"
    echo "python bench/bench.py --gpu (${BENCH_S} s)"
    echo "python bench/checkpoints.py --device cuda --batch 16 --reps 3 (${CHECKPOINTS_S} s)"
    echo "python bench/time_lost.py --kills 5 --lost 5s (${TIME_LOST_S} s)"
    if [[ -f bench/nanogpt.py ]]; then
        echo "python bench/nanogpt.py --quick (${NANOGPT_S} s)"
    else
        echo "bench/nanogpt.py: not in this tree, skipped"
    fi
}

if $DRY; then
    plan
    exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu.sh: torch ($PYTHON) sees no CUDA GPU here; run it on a GPU machine (--dry-run shows the plan)" >&2
    exit 1
fi
if ! "$PYTHON" -c "import cookiecutter" 2>/dev/null; then
    if [[ -z "${GPU_SH_WHEELS:-}" ]]; then
        echo "gpu.sh: cookiecutter is not installed for $PYTHON; install it, or set GPU_SH_WHEELS" \
            "to a folder of its wheels" >&2
        exit 1
    fi
    "$PYTHON" -m pip install --quiet --no-index --find-links "$GPU_SH_WHEELS" cookiecutter || exit 1
fi

LOGS=${OUT:-$(mktemp -d)}/gpu-sh
SCRATCH=$(mktemp -d)
mkdir -p "$LOGS"
trap 'rm -rf "$SCRATCH"' EXIT
echo "gpu.sh: logs in $LOGS"
plan

for task in digits lm; do
    if ! "$PYTHON" -m cookiecutter --no-input . -o "$SCRATCH" "task=$task" >"$LOGS/render-$task.log" 2>&1; then
        echo "gpu.sh: rendering task=$task failed:" >&2
        tail -20 "$LOGS/render-$task.log" >&2
        exit 1
    fi
done
DIGITS=$SCRATCH/digits-classifier
LM=$SCRATCH/char-gpt

# `suite NAME PROJECT ARGS...`: pytest -m cuda in PROJECT, in the background; its log is LOGS/NAME.log.
suite() {
    local name=$1 project=$2
    shift 2
    local ignore=()
    # nbformat is a dev extra that a GPU image may lack; the notebooks' tests are not GPU tests.
    "$PYTHON" -c "import nbformat" 2>/dev/null || ignore=(--ignore tests/test_notebooks.py)
    (
        cd "$project" || exit 1
        PYTHONPATH="$project/src" timeout -k 10 "$SUITE_S" "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
            "${ignore[@]}" "$@"
    ) >"$LOGS/$name.log" 2>&1
}

# `summary LOG`: pytest's last line (e.g. "9 passed, 2 skipped in 180.01s").
summary() { grep -E "passed|failed|error|no tests ran" "$1" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//'; }

echo "gpu.sh: pytest -m cuda (three suites side by side, ${SUITE_S} s each)"
suite digits-cuda "$DIGITS" tests/test_cuda.py &
first=$!
suite digits-rest "$DIGITS" --ignore tests/test_cuda.py &
second=$!
suite lm-cuda "$LM" &
third=$!
for pair in "digits tests/test_cuda.py:$first:digits-cuda" "digits, the other cuda tests:$second:digits-rest" \
    "lm pytest -m cuda:$third:lm-cuda"; do
    IFS=: read -r label pid log <<<"$pair"
    wait "$pid"
    status=$?
    record "$label" "$(result "$status" "$SUITE_S")" "$(summary "$LOGS/$log.log")"
    tail -30 "$LOGS/$log.log"
done

echo "gpu.sh: bench/bench.py --gpu (${BENCH_S} s)"
timeout -k 10 "$BENCH_S" "$PYTHON" bench/bench.py --gpu >"$LOGS/bench.log" 2>&1
status=$?
cat "$LOGS/bench.log"
# One figure per row: the ratio of a loop row, the share of a data-wait row.
figures=$(awk -F'|' '
    /^\| steps\/s/ { split($2, label, ", "); sub(/ \(.*/, "", label[5]); gsub(/^ +| +$/, "", $5)
                     printf "%s %s %s: %s; ", label[3], label[4], label[5], $5 }
    /^\| data wait/ { gsub(/^ +| +$/, "", $3); n = ($2 ~ /default/) ? "default" : "2 workers"
                      printf "data wait %s %s; ", n, $3 }' "$LOGS/bench.log")
record "bench/bench.py --gpu" "$(result "$status" "$BENCH_S")" "${figures:-none}"

echo "gpu.sh: bench/checkpoints.py --device cuda --batch 16 --reps 3 (${CHECKPOINTS_S} s)"
timeout -k 10 "$CHECKPOINTS_S" "$PYTHON" bench/checkpoints.py --device cuda --batch 16 --reps 3 \
    >"$LOGS/checkpoints.log" 2>&1
status=$?
cat "$LOGS/checkpoints.log"
# The sync/background table's rows: variant | loop stop sync ms | background ms | ratio | ...
figures=$(awk -F'|' 'NF > 12 && $3 ~ /^ *[0-9]+ *$/ && $5 ~ /^ *[0-9.]+ *$/ {
    gsub(/ /, "", $2); gsub(/ /, "", $3); gsub(/ /, "", $4); gsub(/ /, "", $5)
    printf "%s: loop stop sync %s ms, background %s ms (%sx); ", $2, $3, $4, $5 }' "$LOGS/checkpoints.log")
record "bench/checkpoints.py --device cuda" "$(result "$status" "$CHECKPOINTS_S")" "${figures:-none}"

echo "gpu.sh: bench/time_lost.py --kills 5 --lost 5s (${TIME_LOST_S} s)"
timeout -k 10 "$TIME_LOST_S" "$PYTHON" bench/time_lost.py --kills 5 --lost 5s >"$LOGS/time-lost.log" 2>&1
status=$?
cat "$LOGS/time-lost.log"
# Per task: the worst kill's loss and the checkpoints' share of the wall time.
figures=$(awk '/, max_time_lost / { printf "%s ", $1 }
    / kills: the worst lost / { printf "%s kills, worst %s s, ", $1, $6 }
    /share of the wall time/ { printf "loop stops %s of the time; ", $9 }' "$LOGS/time-lost.log")
record "bench/time_lost.py" "$(result "$status" "$TIME_LOST_S")" "${figures:-none}"

if [[ -f bench/nanogpt.py ]]; then
    echo "gpu.sh: bench/nanogpt.py --quick (${NANOGPT_S} s)"
    timeout -k 10 "$NANOGPT_S" "$PYTHON" bench/nanogpt.py --quick >"$LOGS/nanogpt.log" 2>&1
    status=$?
    cat "$LOGS/nanogpt.log"
    record "bench/nanogpt.py --quick" "$(result "$status" "$NANOGPT_S")" \
        "$(grep -v '^ *$' "$LOGS/nanogpt.log" | tail -1)"
else
    record "bench/nanogpt.py --quick" "not run" "bench/nanogpt.py is not in this tree"
fi

echo
echo "gpu.sh: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__)')"
echo
echo "| part | result | figures |"
echo "|---|---|---|"
failed=0
for index in "${!PARTS[@]}"; do
    echo "| ${PARTS[$index]} | ${RESULTS[$index]} | ${FIGURES[$index]} |"
    [[ "${RESULTS[$index]}" == "passed" ]] || failed=1
done
exit "$failed"
