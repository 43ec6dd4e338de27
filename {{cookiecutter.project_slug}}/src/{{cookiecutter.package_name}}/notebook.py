"""Train from a notebook cell (docs/platforms.md): the platform's launcher runs as a child process, its
output and progress bar show in the cell, and the stop button makes training save a checkpoint first.

    from {{ cookiecutter.package_name }}.notebook import run_training
    run_training("kaggle", "--num_epochs", "5")   # bash scripts/run_kaggle.sh --num_epochs 5

Not `!bash`: on an interrupt, IPython's `system` (Kaggle's kernel) sends SIGHUP, SIGINT then SIGKILL 0.2 s
apart, which ends train.py at once. Standard library only: this runs before anything is installed."""

from __future__ import annotations

import codecs
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
from itertools import islice
from pathlib import Path
from subprocess import DEVNULL, PIPE, STDOUT

from .utils.training.signals import EXIT_STOPPED

PROJECT = Path(__file__).parents[2]  # src/<package>/notebook.py -> the folder with train.py


def run_training(platform: str, *args: str) -> int:
    """Run `bash scripts/run_<platform>.sh ARGS...` until it exits: 0 when training finished, 75 when a stop
    left a checkpoint (so that "Run all" goes on to the results); RuntimeError when it failed."""
    command = ["bash", f"scripts/run_{platform}.sh", *args]
    print(f"$ {shlex.join(command)}", flush=True)
    # Its own output pipe, read in chunks: lines appear as training writes them, unbuffered, and its
    # progress bar is redrawn in place (not in a Kaggle commit, whose log would keep every frame).
    bar = {"PROGRESS_BAR": str(int(os.environ.get("KAGGLE_KERNEL_RUN_TYPE") != "Batch"))}
    process = subprocess.Popen(
        command, cwd=PROJECT, env=os.environ | bar, stdin=DEVNULL, stdout=PIPE, stderr=STDOUT
    )
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    interrupts = 0
    reported = 0  # the interrupts the output has said so far

    # The stop button (SIGINT to the kernel) is not raised as KeyboardInterrupt: an exception between a read
    # and its write would lose that chunk of output. The read resumes after the handler (PEP 475).
    def interrupt(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            # If Jupyter signalled the process group too, training takes this one as the same press.
            process.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        while chunk := os.read(process.stdout.fileno(), 1 << 16):
            while reported < interrupts:  # each interrupt since the last chunk, said before it
                reported += 1
                print(
                    "\ninterrupt: training saves a checkpoint, then stops (to stop it without one, restart "
                    "the kernel: the run continues from its previous checkpoint)",
                    flush=True,
                )
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
        status = process.wait()  # end of output: training and its workers have closed it
    finally:
        signal.signal(signal.SIGINT, previous)
    process.stdout.close()
    if status == EXIT_STOPPED:  # the stop button, a signal from elsewhere or the clock: a checkpoint saved
        print(f"training stopped (exit {status}): run this cell again to continue; below, what it has so far")
    elif status != 0:
        raise RuntimeError(f"{shlex.join(command)} failed with exit status {status}: its output is above")
    return status


def show_metrics(run: str | Path, lines: int = 5) -> None:
    """The last `lines` rows of the run's metrics.jsonl, its exported model's files and curves.png, if any."""
    metrics = Path(run) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"nothing yet: {metrics} does not exist (training has not logged a step there)")
        return
    print("".join(metrics.read_text(encoding="utf-8").splitlines(keepends=True)[-lines:]), end="")
    model = Path(run) / "model"
    if (model / "export.json").is_file():
        files = ", ".join(f"{path.name} ({path.stat().st_size:,} B)" for path in sorted(model.iterdir()))
        print(f"{model}: {files}")
    else:
        print(f"{model}: not exported yet (training exports at its end and when it stops for time)")
    if (curves := Path(run) / "curves.png").is_file():  # drawn when a training session ends
        from IPython.display import Image, display  # the kernel's own

        display(Image(filename=str(curves)))


def show_predictions(run: str | Path, rows: int = 5) -> None:
    """predict.py with the run's best_model/ (else model/) on the eval split, and its first `rows` rows."""
    best = Path(run) / "best_model"
    output = Path(run) / "predictions.csv"
    model = best if (best / "export.json").is_file() else Path(run) / "model"  # as predict.py chooses
    if not (model / "export.json").is_file():
        print(f"no predictions yet: {model} is exported when training ends or stops for time")
        return
    step = json.loads((model / "export.json").read_text(encoding="utf-8")).get("step")
    command = [sys.executable, "predict.py", "--model_dir", str(model), "--output", str(output)]
    env = dict(os.environ, PYTHONPATH=str(PROJECT / "src"))  # the package, installed or not
    predicting = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, env=env)
    print(predicting.stdout[-2000:], predicting.stderr[-2000:], sep="")
    if predicting.returncode != 0:
        print(f"predict.py failed with exit status {predicting.returncode}: its output is above")
        return
    print(f"{model.name}/, the model of step {step}, first rows of {output}:")
    with output.open(newline="", encoding="utf-8") as file:
        for row in islice(csv.DictReader(file), rows):
            # One line a row: a value's own line breaks (a language model's text) are shown as \\n.
            print(" | ".join(f"{name}: {value}".replace("\n", "\\n") for name, value in row.items()))
