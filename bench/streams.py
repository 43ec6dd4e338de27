"""What the text preset's streamed train set (data_files, training/streams.py) delivers, and print a table.

    python bench/streams.py           # 4 jsonl files of 5,000 passages each, 3 runs per figure
    python bench/streams.py --quick   # 4 files of 500, 1 run (CI-sized: checks, no figures)

1. loader rate: samples per second that the StreamLoader of one process delivers (read, tokenize,
   collate) over one epoch of the files, with num_workers 0, 1 and 2 (and 4 on 8 cores or more), each in
   a fresh process; the time
   runs from the epoch's iter() (starting its workers) to its last batch;
2. data wait: the share of train.py's step time spent in next() on its train loader, at the text
   preset's defaults (configs/local.yaml, num_workers -1: 2 workers for a stream) with --data_files, and
   with num_workers 0 for comparison; on the device train.py picks (a GPU where there is one); every
   fetch timed by wrapping StreamLoader.__iter__, train.py otherwise as it is, summed
   over the steps after the first 5 against their wall time;
3. resume: seconds from a resumed loader's iter() to its first batch, the state taken 1 batch into an
   epoch and 100 batches in (100x the rows read; 20 in --quick), 0 workers, each loader on a fresh stream.
Each figure is the median of 3 runs (1 in --quick), with the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
FILES = 4
WARMUP_STEPS = 5  # the first steps (model set-up, the first batches' workers) are not the steady state

RATE = """
import sys, time, torch
from types import SimpleNamespace
sys.path.insert(0, "src")
from {package} import task
from {package}.utils.config import load_config
from {package}.utils.training.streams import StreamLoader
config, _ = load_config(["--data_files", sys.argv[1], "--max_steps", "1000", "--num_workers", sys.argv[2]],
                        task.PROJECT_DIR / "configs" / "local.yaml", task.Config)
train, _ = task.build_datasets(config)
one = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
loader = StreamLoader(train, config, one, task.collate, pin_memory=False)
loader.set_epoch(0)
started, samples = time.perf_counter(), 0
for batch in loader:
    samples += len(batch["labels"])
print(samples / (time.perf_counter() - started))
"""

RESUME = """
import json, sys, time, torch
from types import SimpleNamespace
sys.path.insert(0, "src")
from {package} import task
from {package}.utils.config import load_config
from {package}.utils.training.streams import StreamLoader
config, _ = load_config(["--data_files", sys.argv[1], "--max_steps", "1000", "--num_workers", "0"],
                        task.PROJECT_DIR / "configs" / "local.yaml", task.Config)
one = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
def loader():  # a fresh stream each time: datasets keeps a loaded position in the stream object
    return StreamLoader(task.build_datasets(config)[0], config, one, task.collate, pin_memory=False)
def seconds_to_resume(batches):
    first = loader()
    first.set_epoch(0)
    taken = iter(first)
    for _ in range(batches):
        next(taken)
    state = first.state_dict()
    del taken
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    started = time.perf_counter()
    next(iter(resumed))
    return time.perf_counter() - started
print(json.dumps([seconds_to_resume(int(batches)) for batches in sys.argv[2:]]))
"""

WAIT = """
import json, runpy, sys, time
sys.path.insert(0, "src")
from {package}.utils.training import streams
fetches = []
original = streams.StreamLoader.__iter__
def timed(self):
    batches = original(self)
    while True:
        begun = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            fetches.append((begun, time.perf_counter()))
            return
        fetches.append((begun, time.perf_counter()))
        yield batch
streams.StreamLoader.__iter__ = timed
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit:
    pass
with open("fetches.json", "w") as file:
    json.dump(fetches, file)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small files, one run: checks, no figures")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (their median); 1 with --quick")
    args = parser.parse_args()
    rows_per_file, reps = (500, 1) if args.quick else (5000, args.reps)
    steps = 12 if args.quick else 60
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as scratch:
        root = Path(scratch)
        command = [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(root)]
        subprocess.run([*command, "task=text"], check=True, capture_output=True)
        project = next(path for path in root.iterdir() if path.is_dir())
        files = write_files(project, root / "files", rows_per_file)
        print("| measurement | value | target |\n| --- | --- | --- |", flush=True)
        for workers in (0, 1, 2, 4) if (os.cpu_count() or 1) >= 8 else (0, 1, 2):
            rates = [rate(project, files, workers) for _ in range(reps)]
            row(f"loader rate, num_workers {workers}", f"{spread(rates, '.0f')} samples/s")
        near, far = resume_seconds(project, files, 100 if not args.quick else 20, reps)
        row("resume to first batch, 1 batch in (64 rows)", f"{spread(near, '.3f')} s")
        far_rows = (100 if not args.quick else 20) * 64
        row(f"resume to first batch, {far_rows:,} rows in", f"{spread(far, '.3f')} s", "<= 1.2x near")
        for workers, name in ((-1, "defaults (2 workers)"), (0, "num_workers 0")):
            runs = [root / f"run-{workers}-{rep}" for rep in range(reps)]
            shares = [wait_share(project, files, workers, steps, run) for run in runs]
            row(
                f"data wait, {name}, % of step time",
                f"{spread(shares, '.1f')}%",
                "< 5%" if workers == -1 else "",
            )
    print(
        f"{FILES} jsonl files of {rows_per_file} passages; median (range) of {reps} run(s); "
        f"{os.cpu_count()} CPUs"
    )


def row(measurement: str, value: str, target: str = "") -> None:
    """One row of the table, printed as soon as it is measured."""
    print(f"| {measurement} | {value} | {target} |", flush=True)


def write_files(project: Path, folder: Path, rows_per_file: int) -> str:
    """FILES jsonl files of the preset's labelled passages, repeated to `rows_per_file` each."""
    lines = (project / "data" / "shakespeare_speakers.txt").read_text(encoding="utf-8").splitlines()
    pairs = [line.split("\t", 1) for line in lines if line.strip() and not line.startswith("#")]
    folder.mkdir()
    for index in range(FILES):
        with (folder / f"part{index}.jsonl").open("w", encoding="utf-8") as file:
            for row in range(rows_per_file):
                label, text = pairs[(index * rows_per_file + row) % len(pairs)]
                file.write(json.dumps({"text": text, "label": label}) + "\n")
    return str(folder / "*.jsonl")


def package_of(project: Path) -> str:
    return next(path.name for path in (project / "src").iterdir() if (path / "task.py").is_file())


def rate(project: Path, files: str, workers: int) -> float:
    code = RATE.format(package=package_of(project))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code, files, str(workers)]
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return float(result.stdout.split()[-1])


def resume_seconds(project: Path, files: str, far: int, reps: int) -> tuple[list[float], list[float]]:
    """Seconds from iter() to the first batch of a loader resumed 1 batch and `far` batches into an epoch."""
    code = RESUME.format(package=package_of(project))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    near_seconds, far_seconds = [], []
    for _ in range(reps):
        command = [sys.executable, "-c", code, files, "1", str(far)]
        result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(result.stderr[-3000:])
        near, far_one = json.loads(result.stdout.splitlines()[-1])
        near_seconds.append(near)
        far_seconds.append(far_one)
    return near_seconds, far_seconds


def wait_share(project: Path, files: str, workers: int, steps: int, output_dir: Path) -> float:
    """Percent of the wall time of the steps after WARMUP_STEPS spent fetching train batches."""
    code = WAIT.format(package=package_of(project))
    args = ["--data_files", files, "--max_steps", str(steps), "--num_workers", str(workers)]
    args += ["--output_dir", str(output_dir), "--eval_every", str(steps), "--checkpoint_every", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=project, env=env, capture_output=True, text=True
    )
    if result.returncode:
        raise SystemExit(result.stdout[-2000:] + result.stderr[-3000:])
    fetches = json.loads((project / "fetches.json").read_text())[WARMUP_STEPS:]
    waited = sum(end - begun for begun, end in fetches[1:])
    return 100 * waited / (fetches[-1][1] - fetches[0][1])


def spread(values: list[float], form: str) -> str:
    middle = format(statistics.median(values), form)
    if len(values) == 1:
        return middle
    return f"{middle} ({format(min(values), form)} to {format(max(values), form)})"


if __name__ == "__main__":
    main()
