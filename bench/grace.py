"""The grace window: seconds from a real SIGTERM to a durable checkpoint and train.py's exit (status 75).

    python bench/grace.py             # GPT-2 small's depth and width, 2 runs per moment
    python bench/grace.py --quick     # a 2-layer model, 1 run (CI-sized: checks, no figures)
    python bench/grace.py --batch 32  # per-device batch (and global batch) of the runs: a GPU's size

The lm preset rendered and trained with train.py as it is (background checkpoints, log_every 10), a
GPT of 12 layers, 12 heads, width 768 over characters (85M parameters), blocks of 128. The signal is sent
at three moments, each found from outside the process:
- mid-step: just after a logging step wrote its train loss (the worst case: a whole logging interval to
  the next stop vote);
- mid-evaluation: as an evaluation starts (the vote after the evaluation acts on it);
- mid-save: as a background checkpoint write starts (the stop waits for it, then saves again).
The moments are marked by wrapping, in the bench's runner only, loop.evaluate and the Persister's
background write so that each first touches a file. Each row gives the seconds from the signal to the
new checkpoint's publish (its folder renamed into place, sealed) and to the process's exit, and the steps
trained after the signal. Compare with the platforms' notice: SLURM's `--signal=USR1@300` (300 s), a spot
VM's 30 s (GCP) to 120 s (AWS).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
EXIT_STOPPED = 75
MOMENTS = ("mid-step", "mid-evaluation", "mid-save")

RUNNER = """
import os, runpy, sys
from pathlib import Path
sys.path.insert(0, "src")
from {package}.utils.checkpoints import persist
from {package}.utils.training import loop
marks = Path(os.environ["GRACE_MARKS"])
def marking(name, function):
    def wrapper(*args, **kwargs):
        (marks / name).touch()
        return function(*args, **kwargs)
    return wrapper
loop.evaluate = marking("evaluation", loop.evaluate)
persist.Persister._persist = marking("write", persist.Persister._persist)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one run: checks, no figures")
    parser.add_argument("--batch", type=int, default=4, help="per-device and global batch (default 4)")
    parser.add_argument("--reps", type=int, default=2, help="runs per moment (their median); 1 with --quick")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    size = ["2", "2", "64"] if args.quick else ["12", "12", "768"]
    model = ["--num_layers", size[0], "--num_heads", size[1], "--embed_dim", size[2], "--block_size", "128"]
    batch = ["--per_device_batch_size", str(args.batch), "--global_batch_size", str(args.batch)]
    every = ["--eval_every", "20", "--checkpoint_every", "20", "--eval_windows", "256"]
    train_args = [*model, *batch, *every, "--max_steps", "100000"]
    with tempfile.TemporaryDirectory(prefix="bench-grace-") as scratch:
        root = Path(scratch)
        command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root)]
        subprocess.run([*command, "task=lm"], check=True, capture_output=True)
        project = next(path for path in root.iterdir() if path.is_dir())
        package = next(path.name for path in (project / "src").iterdir() if (path / "task.py").exists())
        (project / "grace_runner.py").write_text(RUNNER.format(package=package), encoding="utf-8")
        rows = []
        for moment in MOMENTS:
            runs = [grace(project, root / f"{moment}-{rep}", moment, train_args) for rep in range(reps)]
            rows.append((moment, runs))
    print(
        "| moment of the SIGTERM | to the checkpoint's publish, s | to exit 75, s | steps after it "
        "| each exit, s |"
    )
    print("| --- | --- | --- | --- | --- |")
    for moment, runs in rows:
        published = statistics.median(run["published"] for run in runs)
        exited = statistics.median(run["exited"] for run in runs)
        steps = statistics.median(run["steps"] for run in runs)
        each = ", ".join(f"{run['exited']:.1f}" for run in runs)
        print(f"| {moment} | {published:.1f} | {exited:.1f} | {steps:g} | {each} |")
    print(
        "notice given: SLURM --signal=USR1@300: 300 s; a spot VM: 30 s (GCP) to 120 s (AWS); "
        f"{'quick run: not figures' if args.quick else 'medians of ' + str(reps) + ' runs'}"
    )


def grace(project: Path, output_dir: Path, moment: str, train_args: list[str]) -> dict[str, float]:
    """One run of train.py, signalled at `moment`: the seconds to the new checkpoint and to the exit."""
    marks = output_dir.with_name(output_dir.name + "-marks")
    marks.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRACE_MARKS": str(marks)}
    command = [
        sys.executable,
        "grace_runner.py",
        "--config",
        "configs/local.yaml",
        "--output_dir",
        str(output_dir),
    ]
    log = (output_dir.parent / f"{output_dir.name}.log").open("w")
    process = subprocess.Popen(
        [*command, *train_args], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for_moment(process, output_dir, marks, moment)
        before, signalled_step = checkpoints(output_dir), logged_step(output_dir)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        appeared: dict[str, float] = {}  # each checkpoint published after the signal, and when
        while process.poll() is None:
            for name in checkpoints(output_dir) - before - set(appeared):
                appeared[name] = time.monotonic() - signalled
            time.sleep(0.01)
        exited = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    output = (output_dir.parent / f"{output_dir.name}.log").read_text(encoding="utf-8")
    if process.returncode != EXIT_STOPPED:
        raise SystemExit(
            f"{moment}: train.py exited {process.returncode}, not {EXIT_STOPPED}:\n{output[-3000:]}"
        )
    for name in checkpoints(output_dir) - before - set(appeared):  # between the last poll and the exit
        appeared[name] = exited
    if not appeared:
        raise SystemExit(f"{moment}: no new checkpoint after the signal:\n{output[-3000:]}")
    last = max(appeared)  # the stop's own (a write in flight at the signal is published before it)
    steps = int(last.removeprefix("step_")) - signalled_step
    return {"published": appeared[last], "exited": exited, "steps": steps}


def wait_for_moment(process: subprocess.Popen, output_dir: Path, marks: Path, moment: str) -> None:
    """Until the moment to signal comes; after the first checkpoint, so that training is steady."""
    started = time.monotonic()
    while time.monotonic() - started < 3600:
        if process.poll() is not None:
            raise SystemExit(f"train.py ended ({process.returncode}) before the moment {moment}")
        steady = bool(checkpoints(output_dir))
        if moment == "mid-evaluation" and steady and consume(marks / "evaluation"):
            return
        if moment == "mid-save" and steady and consume(marks / "write"):
            return
        if moment == "mid-step" and steady:
            lines = losses(output_dir)
            while losses(output_dir) == lines:  # the next logging step
                time.sleep(0.005)
            return
        consume(marks / "evaluation")  # only a mark made after the run is steady counts
        consume(marks / "write")
        time.sleep(0.005)
    raise SystemExit(f"{moment} never came")


def consume(mark: Path) -> bool:
    try:
        mark.unlink()
    except FileNotFoundError:
        return False
    return True


def checkpoints(output_dir: Path) -> set[str]:
    """The published checkpoints' folder names (a staging folder is not one)."""
    root = output_dir / "checkpoints"
    return {path.name for path in root.glob("step_*")} if root.is_dir() else set()


def losses(output_dir: Path) -> int:
    """How many train losses metrics.jsonl holds."""
    path = output_dir / "metrics.jsonl"
    return path.read_text(encoding="utf-8").count('"train/loss"') if path.exists() else 0


def logged_step(output_dir: Path) -> int:
    """The step of the last line metrics.jsonl holds (read at the signal: the step training was near)."""
    lines = (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return max(json.loads(line)["step"] for line in lines if line.strip())


if __name__ == "__main__":
    main()
