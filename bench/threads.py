"""The digits quick start, `python train.py`, with the threads the project chooses and with OMP_NUM_THREADS=1.

    python bench/threads.py            # 3 runs of each, alternating; a few minutes on 2 busy cores
    python bench/threads.py --quick    # 20 optimizer steps, one run of each (CI runs it)

Each run is a new process in a new output folder, timed from the start of the process to its exit, as a
user times the quick start. The threads that each run used are read from its start line. The load average
of the machine before the runs is printed with the table: on a machine that other work keeps busy, threads
that wait for each other's cores cost far more than on an idle one.

The script renders the template itself; it needs the packages of requirements-dev.txt (torch included).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
SETTINGS = {"chosen by the project": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}


def render(into: Path) -> Path:
    from cookiecutter.main import cookiecutter

    # The defaults a user gets (the digits example, TensorBoard), as the README's quick start renders it.
    return Path(
        cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(into), extra_context={"task": "digits"})
    )


def quick_start(
    project: Path, output_dir: Path, variables: dict[str, str], args: list[str]
) -> tuple[float, str]:
    """Seconds of one `python train.py` run in `output_dir`, and the threads its start line names."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env |= {"PYTHONPATH": str(project / "src"), **variables}
    command = [sys.executable, "train.py", "--output_dir", str(output_dir), *args]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"train.py failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    match = re.search(r"\| CPU threads ([^|]+) \|", result.stdout)
    if match is None:
        sys.exit(f"no CPU threads in the start line:\n{result.stdout[:2000]}")
    return seconds, match.group(1).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps, one run of each")
    options = parser.parse_args()
    runs, args = (1, ["--max_steps", "20"]) if options.quick else (3, [])
    with tempfile.TemporaryDirectory() as folder:
        project = render(Path(folder))
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        threads: dict[str, str] = {}
        for run in range(runs):
            for setting, (name, variables) in enumerate(SETTINGS.items()):
                output_dir = Path(folder) / f"outputs-{run}-{setting}"  # a new run each time
                seconds, threads[name] = quick_start(project, output_dir, variables, args)
                times[name].append(seconds)
    print("| threads | quick start, s (median) | runs, s |")
    print("|---|---|---|")
    for name, values in times.items():
        spread = ", ".join(f"{value:.1f}" for value in values)
        print(f"| {name}: {threads[name]} | {statistics.median(values):.1f} | {spread} |")
    print(
        f"\n{'20 optimizer steps' if options.quick else 'the whole quick start'} of the digits example, "
        f"{runs} run(s) of each, alternating; load average before the runs {load:.2f} on "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    )


if __name__ == "__main__":
    main()
