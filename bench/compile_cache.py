"""The first compiled step after a resume: with the checkpoint's compile cache, on a warm machine, and cold.

    python bench/compile_cache.py            # the lm preset's default model, 3 resumes of each kind
    python bench/compile_cache.py --quick    # one of each

A compiled run of the lm preset (`--compile true`, its default model) trains 10 steps, evaluates and
checkpoints (machine/compile_cache.py puts Inductor's cache artifacts into the checkpoint), in an Inductor
cache folder of its own. Then copies of that run folder are resumed for 4 more steps, in turns:
- with the cache: an empty Inductor cache folder (a new machine, a new Colab session), the checkpoint's
  artifacts loaded;
- warm: the first run's Inductor cache folder, which already holds everything (the same machine again);
- cold: an empty folder and TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, so nothing is found: what every resume
  on a new machine did before the checkpoint carried the cache (torch before 2.7 still does).
The first step is timed from the history's compile-cache line, printed just before the loop starts, to
the appearance of step 11's row in metrics.jsonl (log_every 1); a later step from row 12 to row 13.
Medians over the resumes. The target (on the same GPU kind and torch): with the cache <= 1.2x warm.

It runs on the device torch sees (on the CPU here, where Inductor compiles C++ with the system's compiler);
it needs the packages of requirements-dev.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nanogpt import TEMPLATE, Run, timed

RESUMED_AT, STEPS = 10, 14
WITH_CACHE, WARM = (
    "with the checkpoint's cache (empty Inductor cache)",
    "warm (the first run's Inductor cache)",
)
COLD = "cold (empty, caches disabled)"
TARGET = 1.2
FIRST = ["--compile", "true", "--max_steps", str(RESUMED_AT), "--eval_every", str(RESUMED_AT)]
FIRST += ["--checkpoint_every", str(RESUMED_AT), "--log_every", "1", "--tracker", "none"]
RESUME = ["--compile", "true", "--max_steps", str(STEPS), "--log_every", "1", "--tracker", "none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one resume of each kind")
    reps = 1 if parser.parse_args().quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as scratch:
        root = Path(scratch)
        project = render(root)
        warm_cache = root / "inductor-first"
        first = train(project, root / "first", FIRST, warm_cache, {})
        checkpoint = next((root / "first" / "checkpoints").iterdir())
        cache_file = checkpoint / "compile_cache.bin"
        if not cache_file.is_file():
            sys.exit(f"error: {checkpoint} holds no compile_cache.bin (torch before 2.7?)")
        firsts: dict[str, list[float]] = {WITH_CACHE: [], WARM: [], COLD: []}
        laters: dict[str, list[float]] = {kind: [] for kind in firsts}
        for rep in range(reps):
            kinds = {
                WITH_CACHE: (root / f"empty-{rep}", {}),
                WARM: (warm_cache, {}),
                COLD: (root / f"cold-{rep}", {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}),
            }
            for index, (kind, (inductor, extra)) in enumerate(kinds.items()):
                folder = root / f"resume-{rep}-{index}"
                shutil.copytree(root / "first", folder)
                run = train(project, folder, RESUME, inductor, extra)
                start = next(s for s, line in run.lines if line.startswith("history: compile cache of "))
                rows = {row["step"]: s for s, row in run.rows if "train/loss" in row}
                firsts[kind].append(rows[RESUMED_AT + 1] - start)
                laters[kind].append(rows[RESUMED_AT + 3] - rows[RESUMED_AT + 2])
        size = cache_file.stat().st_size
        total = sum(path.stat().st_size for path in checkpoint.iterdir())
    print(report(firsts, laters, reps, size, total, first))


def render(root: Path) -> Path:
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root), "task=lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: cookiecutter failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return root / "char-gpt"


def train(project: Path, output_dir: Path, args: list[str], inductor: Path, extra: dict[str, str]) -> Run:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(project / "src")}
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(inductor), **extra}
    command = [sys.executable, "train.py", "--config", "configs/local.yaml", "--output_dir", str(output_dir)]
    return timed("train.py", [*command, *args], project, env, metrics=output_dir / "metrics.jsonl")


def report(
    firsts: dict[str, list[float]],
    laters: dict[str, list[float]],
    reps: int,
    size: int,
    total: int,
    first: Run,
) -> str:
    import torch

    warm = statistics.median(firsts[WARM])
    lines = [
        f"The lm preset's default model, --compile true, torch {torch.__version__}, {device_name()}; "
        f"resumed at step {RESUMED_AT}, medians of {reps} resume(s) of each kind",
        f"compile_cache.bin: {size / 1e6:.2f} MB of a {total / 1e6:.1f} MB checkpoint; the first run took "
        f"{first.ended:.0f} s",
        "",
        "| resume | first step, s | against warm | a later step, s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for kind, seconds in firsts.items():
        ratio = statistics.median(seconds) / warm
        mark = f" (target <= {TARGET})" if kind == WITH_CACHE else ""
        lines.append(
            f"| {kind} | {statistics.median(seconds):.2f} | {ratio:.2f}x{mark} "
            f"| {statistics.median(laters[kind]):.3f} |"
        )
    return "\n".join(lines)


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"on {torch.cuda.get_device_name()}"
    return f"on the CPU ({platform.machine()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"


if __name__ == "__main__":
    main()
