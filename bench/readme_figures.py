"""Write the figures the READMEs quote from what a fresh run of each preset's quick start prints.

    python bench/readme_figures.py              # every preset (lm: minutes)
    python bench/readme_figures.py digits text  # some
    python bench/readme_figures.py --check      # say what differs, change nothing (exit 1 if anything does)
    python bench/readme_figures.py --threads 2 images   # another thread count (default 1)
    ATEN_CPU_CAPABILITY=avx2 python bench/readme_figures.py images   # other kernels (default, avx2, avx512)

Each preset is rendered fresh and trained as its README says, `OMP_NUM_THREADS=1 python train.py`. Its last
evaluation (and the text preset's best) replaces each figure quoted in the preset's README.md (docs/task.md
of a render), its overview.md (in the project's README) and, for digits, this repository's README, at
the precision quoted there. A figure quoted as a range ("0.960 to 0.985": what other CPUs, thread counts or
kernels gave, which split sums otherwise) holds a fresh value inside it, and grows to take one outside it.
Times are printed, not written: they depend on the machine. The generated projects' tests
(tests/task/test_task.py: the default config's run) fail when a run gives a figure outside the quoted one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
PRESETS = TEMPLATE / "{{cookiecutter.project_slug}}" / "_presets"
FIGURE = r"(\d+\.\d+(?: to \d+\.\d+)?)"  # a figure, or the range measured: "0.960 to 0.985"
ACCURACY, LOSS = rf"eval accuracy \**{FIGURE}", rf"eval\s+loss\s+\**{FIGURE}"
# preset: (pattern whose one group is a quoted figure, the figure's name in `figures`), in each page of the
# preset; digits' figure in the repository's README too.
QUOTES = {
    "digits": [(ACCURACY, "eval/accuracy"), (LOSS, "eval/loss")],
    "images": [(ACCURACY, "eval/accuracy"), (LOSS, "eval/loss")],
    "text": [
        (ACCURACY, "eval/accuracy"),
        (LOSS, "eval/loss"),
        (rf"best {FIGURE} at step", "best eval/accuracy"),
        (r"best [\d. to]+ at step (\d+)", "best step"),
    ],
    "lm": [(LOSS, "eval/loss"), (rf"perplexity\s+\**{FIGURE}", "eval/perplexity")],
}
REPOSITORY_README = (rf"`eval/accuracy {FIGURE}`", "eval/accuracy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", help=f"some of {', '.join(QUOTES)} (default: all)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a figure differs")
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the runs (default 1)")
    args = parser.parse_args()
    if unknown := set(args.presets) - set(QUOTES):
        parser.error(f"no preset {', '.join(sorted(unknown))}: choose among {', '.join(QUOTES)}")
    differs = False
    for preset in args.presets or QUOTES:
        figures, seconds = fresh_run(preset, args.threads)
        kernels = os.environ.get("ATEN_CPU_CAPABILITY", "the CPU's best")
        print(
            f"{preset}: {json.dumps(figures)} in {seconds:.0f} s (OMP_NUM_THREADS={args.threads}, {kernels})"
        )
        pages = [(PRESETS / preset / name, QUOTES[preset]) for name in ("README.md", "overview.md")]
        if preset == "digits":
            pages.append((TEMPLATE / "README.md", [REPOSITORY_README]))
        for page, quotes in pages:
            differs |= rewrite(page, quotes, figures, args.check)
    return 1 if differs and args.check else 0


def fresh_run(preset: str, threads: str = "1") -> tuple[dict[str, float], float]:
    """The figures of the preset's quick start, rendered and run in a fresh folder, and its seconds."""
    with tempfile.TemporaryDirectory(prefix="readme-figures-") as scratch:
        command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", scratch]
        subprocess.run([*command, f"task={preset}"], check=True, capture_output=True)
        project = next(Path(scratch).iterdir())
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(project / "src")}
        start = time.monotonic()
        subprocess.run([sys.executable, "train.py"], cwd=project, env=env, check=True, capture_output=True)
        seconds = time.monotonic() - start
        lines = (project / "outputs" / preset / "metrics.jsonl").read_text().splitlines()
    evaluations = [row for row in map(json.loads, lines) if any(key.startswith("eval/") for key in row)]
    figures = dict(evaluations[-1])
    if "eval/accuracy" in figures:  # the first of the best, as best_model/ keeps it
        best = max(evaluations, key=lambda row: row["eval/accuracy"])
        figures.update({"best eval/accuracy": best["eval/accuracy"], "best step": best["step"]})
    return figures, seconds


def rewrite(page: Path, quotes: list[tuple[str, str]], figures: dict[str, float], check: bool) -> bool:
    """Put `figures` in place of those `quotes` find in `page`, at the precision quoted (a range: widened to
    hold them); True if any moved."""
    text = new = page.read_text(encoding="utf-8")
    for pattern, name in quotes:

        def fresh(match: re.Match[str], name: str = name) -> str:
            low, _, high = match.group(1).partition(" to ")
            decimals = len(low.partition(".")[2])
            value = f"{figures[name]:.{decimals}f}"
            if high:  # the range measured, as wide as the values it has seen
                low, high = min(low, value, key=float), max(high, value, key=float)
                value = f"{low} to {high}"
            (start, end), offset, whole = match.span(1), match.start(), match.group(0)
            return whole[: start - offset] + value + whole[end - offset :]

        new = re.sub(pattern, fresh, new)
    for before, after in zip(text.splitlines(), new.splitlines(), strict=True):
        if before != after:
            print(f"  {page.relative_to(TEMPLATE)}:\n    {before.strip()}\n -> {after.strip()}")
    if new != text and not check:
        page.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    sys.exit(main())
