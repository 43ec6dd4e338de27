"""What a kill without warning costs: SIGKILL at random moments, then the rerun, against max_time_lost.

    python bench/time_lost.py           # digits (hidden_size 1024), lm (its preset's model): 20 kills each
    python bench/time_lost.py --quick   # digits' default model, 2 kills (CI-sized: the checks alone)
    python bench/time_lost.py --lost 10s --kills 10 --tasks lm

A session that ends without a signal (a recycled Colab runtime, a closed tab, a dead node) must lose at
most max_time_lost of training, plus the step in progress. For each task the bench renders the template,
then runs train.py as it is (configs/local.yaml, background checkpoints, the shorter --lost the bench
sets, since runs on a CPU are short):
- an uninterrupted run with max_time_lost, whose exported weights are the reference;
- the same run without checkpoints for time (max_time_lost '', checkpoint_every 0): the checkpoints'
  share of the wall time is the sum of the loop's stops for them (as SessionClock.saved measures each)
  over the training time (first to last step), and the difference of the two runs' training times (which
  also holds what the background writes take from training where they share its CPU cores);
- one chain of sessions, each killed with SIGKILL at a random moment after its loop started (up to three
  max_time_lost later), then run again, until the last one finishes: its exported weights must equal the
  reference's bit for bit, and each rerun says whether its first step is the killed run's ("resume
  verified").
The training lost by a kill is the time from the kill back to when the killed session reached the step
the rerun resumed from. Every step's time comes from the run itself: the bench's runner wraps the
Progress of training/progress.py, which train.py's loop updates once per optimizer step, so that each update
appends the step and the wall time to a file (a SIGKILL keeps what was written), and SessionClock.saved,
so that each checkpoint's loop stop is appended too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent

RUNNER = """
import os, runpy, sys, time
sys.path.insert(0, "src")
from {package}.utils.training import progress, timing
marks = open(os.environ["TIME_LOST_MARKS"], "a", buffering=1)
begin, update, saved = progress.Progress.__init__, progress.Progress.update, timing.SessionClock.saved
def started(self, total, initial, *args, **kwargs):
    begin(self, total, initial, *args, **kwargs)
    marks.write(f"start {{initial}} {{time.time()}}\\n")
def stepped(self):
    update(self)
    marks.write(f"step {{self.step}} {{time.time()}}\\n")
def stopped(self, step, started, written=0.0):
    saved(self, step, started, written)
    marks.write(f"stop {{step}} {{self.stop_s}}\\n")
progress.Progress.__init__, progress.Progress.update, timing.SessionClock.saved = started, stepped, stopped
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""

# Each task's model flags (the bench's realistic size, bench/bench.py; lm: its preset's) and run length
TASKS = {
    "digits": (["--hidden_size", "1024"], 3000),
    "lm": ([], 300),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="digits' default model, 2 kills: the checks")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per task (default 20)")
    parser.add_argument("--lost", default="5s", help="max_time_lost of the runs (default 5s)")
    parser.add_argument("--steps", type=int, help="optimizer steps of a run (default: the task's)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    args = parser.parse_args()
    tasks = ["digits"] if args.quick else args.tasks
    kills, lost = (2, "1s") if args.quick else (args.kills, args.lost)
    chooser = random.Random(args.seed)
    failed = False  # a resume not exact, or a kill that lost more than its bound
    with tempfile.TemporaryDirectory(prefix="bench-time-lost-") as scratch:
        for task in tasks:
            model, steps = ([], 300) if args.quick else TASKS[task]
            flags = [*model, "--max_steps", str(args.steps or steps), "--num_epochs", "1000"]
            project = render(Path(scratch), task)
            within, exact = bench_task(project, Path(scratch) / task, flags, lost, kills, chooser, args.quick)
            failed |= not (exact and within)
    print("quick run: checks, not figures" if args.quick else "wall times on a machine shared with others")
    sys.exit(1 if failed else 0)


def render(into: Path, task: str) -> Path:
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(into / "render")]
    subprocess.run([*command, f"task={task}"], check=True, capture_output=True)
    project = next(path for path in (into / "render").iterdir() if path.name.startswith(("digits", "char")))
    package = next(path.name for path in (project / "src").iterdir() if (path / "task.py").exists())
    (project / "time_lost_runner.py").write_text(RUNNER.format(package=package), encoding="utf-8")
    return project


def bench_task(
    project: Path, root: Path, flags: list[str], lost: str, kills: int, chooser: random.Random, quick: bool
) -> tuple[bool, bool]:
    """The reference, the run without checkpoints for time, the chain of kills; a table. Returns whether
    every kill lost at most its bound, and whether every resume was exact. `quick`: a session is also killed
    once it has trained its share of the steps left, so that a fast machine cannot finish it first."""
    lost_s = parse_seconds(lost)
    root.mkdir(parents=True)
    reference = session(project, root / "reference", [*flags, "--max_time_lost", lost])
    plain = session(project, root / "plain", [*flags, "--max_time_lost", "", "--checkpoint_every", "0"])
    chain, killed, final = root / "chain", [], None
    while final is None:
        moment = chooser.uniform(0, 3 * lost_s) if len(killed) < kills else None
        done = max(killed[-1]["reached"]) if killed else 0
        total = int(flags[flags.index("--max_steps") + 1])
        share = done + (total - done) // (kills - len(killed) + 1) if quick else None
        run = session(
            project, chain, [*flags, "--max_time_lost", lost], kill_after=moment, kill_at_step=share
        )
        if run["killed_at"] is None:  # it ran to its end, before its kill came or with none
            final = run
        else:
            killed.append(run)
    reruns = [*killed[1:], final]
    print(f"\n{project.name}, max_time_lost {lost}: {' '.join(flags)}\n")
    print(
        "| kill | s after the loop started | resumed from step | training lost, s | bound, s | within "
        "| the rerun's first step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    within_all, exact_all, worst = True, True, 0.0
    for number, (run, rerun) in enumerate(zip(killed, reruns, strict=True), start=1):
        reached, resumed = run["reached"], rerun["first"]
        if resumed not in reached:
            raise SystemExit(f"kill {number}: the rerun resumed from step {resumed}, never reached before it")
        times = sorted(reached.values())
        bound = lost_s + max(b - a for a, b in itertools.pairwise(times))  # plus its longest step
        lost_now = run["killed_at"] - reached[resumed]
        verdict = resume_verdict(rerun["output"])
        within_all, exact_all = within_all and lost_now <= bound, exact_all and verdict != "DIFFERS"
        worst = max(worst, lost_now)
        after = run["killed_at"] - run["started"]
        print(
            f"| {number} | {after:.1f} | {resumed} | {lost_now:.2f} | {bound:.2f} | "
            f"{'yes' if lost_now <= bound else 'NO'} | {verdict} |"
        )
    equal = same_weights(root / "reference" / "model", chain / "model")
    share = reference["training"] / plain["training"] - 1
    print(
        f"\n{len(killed)} kills: the worst lost {worst:.2f} s (max_time_lost {lost}); each within "
        f"max_time_lost plus its session's longest step: {'yes' if within_all else 'NO'}; no rerun's "
        f"first step differs from the killed run's: {'yes' if exact_all else 'NO'}; the last rerun's "
        f"exported weights equal the uninterrupted run's: {'yes' if equal else 'NO'}"
    )
    stops = reference["stops"] / reference["training"]
    print(
        f"checkpoints' share of the wall time: loop stops {stops:.2%} (target: at most 2%); against the run "
        f"without them {share:+.1%} (training {reference['training']:.1f} s with {reference['checkpoints']} "
        f"checkpoints, {plain['training']:.1f} s with {plain['checkpoints']})"
    )
    return within_all, exact_all and equal and len(killed) == kills


def session(
    project: Path,
    output_dir: Path,
    flags: list[str],
    kill_after: float | None = None,
    kill_at_step: int | None = None,
) -> dict:
    """One train.py process into `output_dir` (continuing what is there); with `kill_after`, SIGKILLed that
    many seconds after its loop started (or once it reached `kill_at_step`), unless it ended first. Raises
    if it failed."""
    known = len(read_marks(output_dir))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["TIME_LOST_MARKS"] = str(output_dir.with_name(output_dir.name + ".marks"))
    command = [sys.executable, "time_lost_runner.py", "--config", "configs/local.yaml"]
    log = output_dir.with_name(output_dir.name + ".log")
    killed_at = None
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--output_dir", str(output_dir), *flags],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        if kill_after is not None:
            while process.poll() is None and not any(m[0] == "start" for m in read_marks(output_dir)[known:]):
                time.sleep(0.005)
            deadline = time.time() + kill_after
            while process.poll() is None and time.time() < deadline:
                if has_reached(output_dir, kill_at_step):
                    break
                time.sleep(0.002)
            if process.poll() is None:
                process.kill()
                killed_at = time.time()
        status = process.wait()
    output = log.read_text(encoding="utf-8")
    if killed_at is None and status != 0:
        raise SystemExit(f"train.py failed ({status}):\n{output[-3000:]}")
    marks = read_marks(output_dir)[known:]
    start = next(mark for mark in marks if mark[0] == "start")
    reached = {int(start[1]): float(start[2])}
    reached |= {int(mark[1]): float(mark[2]) for mark in marks if mark[0] == "step"}
    steps = [float(mark[2]) for mark in marks if mark[0] == "step"]
    return {
        "killed_at": killed_at,
        "started": float(start[2]),
        "first": int(start[1]),  # the step it resumed from
        "reached": reached,  # step -> the wall time it was reached at
        "training": steps[-1] - steps[0] if len(steps) > 1 else 0.0,
        "checkpoints": output.count("checkpoint: step"),
        "stops": sum(float(mark[2]) for mark in marks if mark[0] == "stop"),  # the loop's, for checkpoints
        "output": output,
    }


def has_reached(output_dir: Path, step: int | None) -> bool:
    """Whether the session writing `output_dir`'s marks has reached `step` (its last line's step)."""
    marks = output_dir.with_name(output_dir.name + ".marks")
    if step is None or not marks.exists():
        return False
    with marks.open("rb") as file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - 200))
        lines = file.read().decode().splitlines()
    last = lines[-2].split() if len(lines) > 1 else []  # the last line may be half-written
    return len(last) == 3 and last[0] == "step" and int(last[1]) >= step


def resume_verdict(output: str) -> str:
    """What a rerun said of its first step against the killed run's record (training/resume_check.py)."""
    for line in output.splitlines():
        if line.startswith("resume verified"):
            return "verified"
        if line.startswith("resume not verified"):
            return "not recorded (killed before the step after a checkpoint was)"
        if line.startswith("resume differs"):
            return "DIFFERS"
    return "none (killed before its first step)"


def read_marks(output_dir: Path) -> list[list[str]]:
    """The runner's lines for `output_dir`, each [kind, step, wall time] ("start" or "step")."""
    marks = output_dir.with_name(output_dir.name + ".marks")
    if not marks.exists():
        return []
    return [line.split() for line in marks.read_text(encoding="utf-8").splitlines() if line.count(" ") == 2]


def same_weights(first: Path, second: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    ones, twos = (load_file(folder / "model.safetensors") for folder in (first, second))
    return ones.keys() == twos.keys() and all(torch.equal(ones[name], twos[name]) for name in ones)


def parse_seconds(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    return float(text[:-1]) * units[text[-1]]


if __name__ == "__main__":
    main()
