"""bench/bench.py in its quick mode: it renders, trains, checkpoints and prints a complete table.

The figures of a quick run are not meaningful (too few steps) and nothing here asserts a speed: the
test keeps the script from rotting. docs/benchmarks.md holds the figures of a full run.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .conftest import TEMPLATE, explain, run, tool

ROWS = {
    "steps/s, tiny model": "loop",
    "steps/s, realistic model": "loop",
    "steps/s, rollback and spike checks on": "loop",
    "checkpoint save, ms (": "pair",
    "checkpoint save, ms, against torch.save + fsync": "pair",
    "resume, ms": "pair",
    "cookiecutter to first optimizer step, s": "single",
    "syncs outside torch at ordinary steps, per second / per logging step": "syncs",
    "data wait, default example (augmentation on": "percent",
    "data wait, num_workers 2": "percent",
    "reseeding per micro-batch, us": "share",
    "digest of the step after a checkpoint, ms": "share",
}


def number(cell: str) -> float:
    match = re.match(r"\s*(-?[0-9.]+)", cell)
    assert match, f"no number in {cell!r}"
    return float(match.group(1))


@pytest.mark.slow
def test_quick_benchmark_prints_every_row() -> None:
    result = run([sys.executable, "bench/bench.py", "--quick"], cwd=TEMPLATE, timeout=900)
    assert result.returncode == 0, explain(result)
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert lines[0].startswith("| measurement | generated project | plain PyTorch | ratio |"), result.stdout
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in lines[1:]
    }
    for prefix, kind in ROWS.items():
        found = [cells for name, cells in rows.items() if name.startswith(prefix)]
        assert len(found) == 1, f"row {prefix!r} missing or repeated in:\n{result.stdout}"
        cells = found[0]
        if kind in ("loop", "pair"):
            generated, plain, ratio = number(cells[0]), number(cells[1]), number(cells[2])
            assert generated > 0 and plain > 0 and ratio > 0
            if kind == "pair":  # the table rounds to whole ms: the ratio lies within that rounding
                low, high = (generated - 0.5) / (plain + 0.5), (generated + 0.5) / max(plain - 0.5, 1e-9)
                assert low - 0.01 <= ratio <= high + 0.01, (cells, low, high)
        elif kind == "single":
            assert number(cells[0]) > 0
        elif kind == "share":  # a cost of exactness, and its share of the steps it is paid on
            assert number(cells[0]) > 0 and 0 < number(cells[2]) < 100, cells
        elif kind == "percent":  # a share of the step time spent fetching batches
            assert cells[0].split()[0].endswith("%"), cells
            assert 0 < number(cells[0]) < 100, f"data wait {cells[0]}"
        else:
            # Between logging steps the generated loop reads back from the device only to vote, about
            # twice a second (utils/training/timing.py: VOTE_S); the plain loop never.
            assert 0 <= number(cells[0]) <= 4, f"syncs at ordinary steps, per second: {cells[0]}"
            assert cells[1].startswith("0.0 / "), f"the plain loop has syncs: {cells[1]}"
    assert "Sync call sites at logging steps: loop.py:" in result.stdout  # Bookkeeping.log's one reduce
    assert "Data wait: the generated train.py as is" in result.stdout


def test_gpu_script_passes_shellcheck_and_plans_every_part() -> None:
    """bench/gpu.sh (run where a GPU is lent) is shellcheck-clean; --dry-run names every part with its time
    limit, and each script it names exists and takes the options it is given."""
    result = run([tool("shellcheck"), "bench/gpu.sh"], cwd=TEMPLATE)
    assert result.returncode == 0, explain(result)
    plan = run(["bash", "bench/gpu.sh", "--dry-run"], cwd=TEMPLATE)
    assert plan.returncode == 0, explain(plan)
    for part in ("task=digits and task=lm", "pytest -m cuda", "bench/bench.py --gpu", "bench/checkpoints.py"):
        assert part in plan.stdout, plan.stdout
    assert ("bench/nanogpt.py --quick" in plan.stdout) == (TEMPLATE / "bench" / "nanogpt.py").is_file()
    for script, option in (("bench/bench.py", "--gpu"), ("bench/checkpoints.py", "--device")):
        helped = run([sys.executable, script, "--help"], cwd=TEMPLATE)
        assert helped.returncode == 0 and option in helped.stdout, explain(helped)


def test_gpu_runs_refuse_a_machine_without_a_gpu_in_one_line() -> None:
    """Where torch sees no GPU, bench/gpu.sh and bench.py --gpu stop at once, saying why."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu.sh would run")
    env = {**os.environ, "PYTHON": sys.executable}
    script = run(["bash", "bench/gpu.sh"], cwd=TEMPLATE, env=env)
    assert script.returncode == 1 and "sees no CUDA GPU here" in script.stderr, explain(script)
    bench = run([sys.executable, "bench/bench.py", "--gpu"], cwd=TEMPLATE)
    assert bench.returncode == 1, explain(bench)
    assert bench.stderr.strip() == "bench: --gpu needs a CUDA GPU, and torch sees none here"


@pytest.mark.slow
def test_quick_time_lost_benchmark_kills_reruns_within_the_bound_and_ends_bitwise_equal() -> None:
    """bench/time_lost.py --quick: two SIGKILLs of a digits run (max_time_lost 1s), each rerun; a row per kill
    whose training lost is within max_time_lost plus the session's longest step (the script fails otherwise),
    no rerun whose first step differs from the killed run's, and the last rerun's exported weights equal to
    the uninterrupted run's."""
    result = run([sys.executable, "bench/time_lost.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row[0]) for row in rows] == [1, 2], result.stdout
    for row in rows:
        assert 0 <= number(row[3]) <= number(row[4]) and row[5].strip() == "yes", row
        assert "DIFFERS" not in row[6], row
    assert "the last rerun's exported weights equal the uninterrupted run's: yes" in result.stdout
    assert re.search(r"checkpoints' share of the wall time: loop stops [0-9.]+%", result.stdout), (
        result.stdout
    )


@pytest.mark.slow
def test_quick_item_seed_benchmark_prints_the_share_of_a_step() -> None:
    """bench/item_seeds.py --quick: an images step in ms, what seeding its items adds, and the share."""
    result = run([sys.executable, "bench/item_seeds.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    found = re.search(
        r"a step ([\d.]+) ms; seeding its items adds ([\d.]+) ms, ([\d.]+)% of the step", result.stdout
    )
    assert found and all(float(value) > 0 for value in found.groups()), result.stdout


@pytest.mark.slow
def test_quick_shard_benchmark_prints_every_row() -> None:
    """bench/shards.py --quick: a 16 MB corpus prepared and trained from; every row holds a number."""
    result = run([sys.executable, "bench/shards.py", "--quick"], cwd=TEMPLATE, timeout=900)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| measurement | value | target |", result.stdout
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert len(names) == 11 and all(name.startswith(("prepare: ", "train from ")) for name in names), names
    for row in rows[1:]:
        assert number(row.split("|")[2]) > 0, row
    peak = next(row for row in rows if row.startswith("| prepare: peak resident memory"))
    assert number(peak.split("|")[2]) < 1500, peak


@pytest.mark.slow
def test_quick_memory_benchmark_prints_both_settings() -> None:
    """bench/memory.py --quick: a tiny BERT with and without gradient checkpointing, a number in each cell."""
    result = run([sys.executable, "bench/memory.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| gradient_checkpointing | peak memory (RSS), MiB | step, s |", result.stdout
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["false", "true"], result.stdout
    for row in rows[1:]:
        assert number(row.split("|")[2]) > 0 and number(row.split("|")[3]) > 0, row


@pytest.mark.slow
def test_quick_checkpoint_benchmark_saves_and_resumes_both_variants() -> None:
    """bench/checkpoints.py --quick: the full and the LoRA checkpoint are saved, resumed (the worker checks
    that the trained parameters come back) and timed, and the LoRA one is the smaller."""
    result = run([sys.executable, "bench/checkpoints.py", "--quick"], cwd=TEMPLATE, timeout=300)
    assert result.returncode == 0, explain(result)
    rows = {
        line.split("|")[1].split()[0]: [number(cell) for cell in line.split("|")[2:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| full (") or line.startswith("| lora (")
    }
    assert set(rows) == {"full", "lora"}, result.stdout
    for megabytes, save, plain_save, save_ratio, load, plain_load, load_ratio in rows.values():
        assert megabytes > 0 and save > 0 and load > 0
        for ours, plain, ratio in ((save, plain_save, save_ratio), (load, plain_load, load_ratio)):
            low, high = (ours - 0.5) / (plain + 0.5), (ours + 0.5) / max(plain - 0.5, 1e-9)
            assert low - 0.01 <= ratio <= high + 0.01, (ours, plain, ratio)
    assert rows["lora"][0] < rows["full"][0]
    assert re.search(r"LoRA checkpoint size: [0-9.]+% of the full one", result.stdout), result.stdout
    # sync against background (kept buffers, and buffers allocated anew), each a figure, both variants
    background = {
        line.split("|")[1].strip(): [number(cell) for cell in line.split("|")[2:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| full |") or line.startswith("| lora |")
    }
    assert set(background) == {"full", "lora"}, result.stdout
    for sync, stop, ratio, anew, write, *_, staged in background.values():
        assert min(sync, stop, anew, write, staged) > 0 and ratio > 0
    assert background["lora"][-1] < background["full"][-1]  # the staged copy: the adapter's is smaller


@pytest.mark.slow
def test_quick_thread_benchmark_times_both_settings() -> None:
    """bench/threads.py --quick: the quick start with the project's threads and with OMP_NUM_THREADS=1, each
    timed, each with the threads its start line named."""
    result = run([sys.executable, "bench/threads.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| threads | quick start, s (median) | runs, s |", result.stdout
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert len(names) == 2 and names[0].startswith("chosen by the project: "), names
    assert names[1] == "OMP_NUM_THREADS=1: 1 (OMP_NUM_THREADS)", names
    for row in rows[1:]:
        assert number(row.split("|")[2]) > 0, row


# Below the line budgets (bench/sizes.py BUDGETS), the renders may not grow past where they are now.
LINES_REACHED = {"digits: Python outside tests/, lines": 7398, "lm: Python outside tests/, lines": 8169}


@pytest.mark.slow
def test_size_budget_places_every_generated_file_in_a_room_and_every_budget_holds() -> None:
    """bench/sizes.py (docs/sizes.md): every preset renders, every generated file is in a room (else the
    script stops naming it), each room holds lines, and the code total is the rooms' sum. Each budget holds
    (the longest function and class, the README's and the docs' words), the lines as LINES_REACHED says."""
    result = run([sys.executable, "bench/sizes.py"], cwd=TEMPLATE, timeout=300)
    assert result.returncode == 0, explain(result)
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [cell.strip() for cell in rows[0]][-2:] == ["code in all", "docs"], result.stdout
    assert [row[0].strip() for row in rows[1:5]] == ["digits", "images", "text", "lm"], result.stdout
    for row in rows[1:5]:
        counts = [int(cell) for cell in row[1:]]
        assert all(count > 0 for count in counts), row
        assert sum(counts[:-2]) == counts[-2], row
    budgets = {row[0].strip(): row for row in rows[6:]}
    assert len(budgets) == 6, result.stdout
    for name, (_, most, figure, where) in budgets.items():
        limit = LINES_REACHED.get(name, int(most))
        assert int(figure.split()[0]) <= limit, f"{name}: {figure.strip()} over {limit} ({where.strip()})"


@pytest.mark.slow
def test_durability_benchmark_prints_every_figure() -> None:
    """bench/durability.py with a 1 MiB export: each of its five lines holds a number of milliseconds."""
    result = run([sys.executable, "bench/durability.py", "--export_mib", "1"], cwd=TEMPLATE, timeout=300)
    assert result.returncode == 0, explain(result)
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "start",
        "start",
        "per checkpoint",
        "per export of 1 MiB",
        "import of a copy",
    ], result.stdout
    assert all(re.search(r" [0-9.]+ ms", line) for line in lines), result.stdout


def test_quick_fingerprint_benchmark_prints_every_row() -> None:
    """bench/fingerprint.py --quick: files, in-memory data and each preset's start-up, each a number."""
    result = run([sys.executable, "bench/fingerprint.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [cell.strip() for cell in rows[0].split("|")[1:-1]] == ["measurement", "value", "target"]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert len(names) == 8 and names[0].startswith("files, warm") and names[-1].startswith("start-up, lm"), (
        names
    )
    for row in rows[1:]:
        assert number(row.split("|")[2]) >= 0, row


@pytest.mark.slow
def test_quick_stream_benchmark_prints_every_row() -> None:
    """bench/streams.py --quick: the text preset's stream loader at 0, 1 and 2 workers, a resume near and far
    into an epoch, and the data wait of train.py on it, each a number."""
    result = run([sys.executable, "bench/streams.py", "--quick"], cwd=TEMPLATE, timeout=900)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    rates = ["loader rate, num_workers 0", "loader rate, num_workers 1", "loader rate, num_workers 2"]
    if (os.cpu_count() or 1) >= 8:
        rates.append("loader rate, num_workers 4")
    assert names == [
        *rates,
        "resume to first batch, 1 batch in (64 rows)",
        "resume to first batch, 1,280 rows in",
        "data wait, defaults (2 workers), % of step time",
        "data wait, num_workers 0, % of step time",
    ], result.stdout
    for row in rows[1:]:
        assert number(row.split("|")[2]) > 0, row


@pytest.mark.slow
def test_quick_grace_benchmark_times_a_real_signal_at_each_moment() -> None:
    """bench/grace.py --quick: train.py signalled mid-step, mid-evaluation and mid-save, each a number; a
    signal during an evaluation is acted on right after it (no more steps), the others at the next logging
    step at most (log_every 10)."""
    result = run([sys.executable, "bench/grace.py", "--quick"], cwd=TEMPLATE, timeout=600)
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    cells = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]] for row in rows[1:]}
    assert list(cells) == ["mid-step", "mid-evaluation", "mid-save"], result.stdout
    for published, exited, steps, _ in cells.values():
        assert 0 < number(published) <= number(exited) and 0 <= number(steps) <= 10, result.stdout
    assert number(cells["mid-evaluation"][2]) == 0, result.stdout


NANOGPT = TEMPLATE / ".nanogpt"  # bench/nanogpt.py's default checkout; git ignores it


@pytest.mark.slow
@pytest.mark.skipif(
    not (NANOGPT / "train.py").is_file(),
    reason=f"no nanoGPT checkout in {NANOGPT}: git clone https://github.com/karpathy/nanoGPT .nanogpt",
)
def test_nanogpt_comparison_trains_both_on_the_cpu_and_prints_one_row_per_mode() -> None:
    """bench/nanogpt.py on the CPU, a tiny model, eager only: nanoGPT's own train.py and the preset's both
    train and evaluate, and the row holds their tokens/s, final losses and times, with consistent ratios."""
    tiny = ["--steps", "40", "--eval_every", "20", "--eval_iters", "4", "--log_every", "4"]
    command = [sys.executable, "bench/nanogpt.py", "--device", "cpu", "--quick", "--compile", "false", *tiny]
    result = run(command, cwd=TEMPLATE, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, explain(result)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| torch.compile | tokens/s nanoGPT | tokens/s preset | ratio (target >= 1.0) ")
    assert len(rows) == 2 and rows[1].startswith("| off |"), result.stdout
    cells = [cell.strip() for cell in rows[1].split("|")[2:-1]]
    nano_rate, preset_rate = (number(cell.replace(",", "")) for cell in cells[:2])
    rate_ratio = number(cells[2])
    assert nano_rate > 0 and preset_rate > 0
    assert abs(rate_ratio - preset_rate / nano_rate) < 0.02, cells
    nano_loss, preset_loss = number(cells[3]), number(cells[4])
    assert 0 < nano_loss < 4.2 and 0 < preset_loss < 4.2  # below guessing among 65 characters: ln 65 = 4.17
    assert number(cells[5]) > 0
    assert cells[6] == "not reached" or number(cells[6]) > 0, cells
    assert "2 layers x 2 heads x 64, block 32, batch 12, 40 steps" in result.stdout


def test_nanogpt_comparison_without_a_checkout_is_one_line(tmp_path: Path) -> None:
    result = run([sys.executable, "bench/nanogpt.py", "--nanogpt", str(tmp_path)], cwd=TEMPLATE)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: {tmp_path} is not a nanoGPT checkout (no train.py, model.py, configurator.py, "
        f"config/train_shakespeare_char.py): git clone https://github.com/karpathy/nanoGPT {tmp_path}, "
        "or give --nanogpt PATH"
    )
