"""Train from a notebook cell: the platform's launcher runs as a child process, its output shows in the
cell, and the stop button (a kernel interrupt) makes training save a checkpoint before it stops.

    from {{ cookiecutter.package_name }}.notebook import run_training
    run_training("kaggle", "--num_epochs", "5")   # bash scripts/run_kaggle.sh --num_epochs 5

Why not `!bash scripts/run_kaggle.sh`: on an interrupt, a standard Jupyter kernel (Kaggle's) sends ^C to
the command's terminal, waits 0.2 s, then kills it (SIGHUP, SIGINT, SIGKILL; IPython's pexpect-based
`system`). SIGHUP ends train.py at once, so a step or a checkpoint that takes longer is lost. Here the
first interrupt reaches training as one SIGINT and the cell waits until training has saved its
checkpoint and exited; a later interrupt only says so. Restarting the kernel still kills it.

Standard library only: this runs in the notebook's kernel, before anything is installed.
"""

from __future__ import annotations

import codecs
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .utils.signals import EXIT_STOPPED

PROJECT = Path(__file__).parents[2]  # src/<package>/notebook.py -> the folder with train.py


def run_training(platform: str, *args: str) -> None:
    """Run `bash scripts/run_<platform>.sh ARGS...` from the project folder until it exits.

    Returns when training finished. Raises KeyboardInterrupt when an interrupt stopped it (its checkpoint
    saved), so that "Run all" stops here too, and RuntimeError when it failed.
    """
    command = ["bash", f"scripts/run_{platform}.sh", *args]
    print(f"$ {shlex.join(command)}", flush=True)
    # Its own output pipe, read in chunks: lines appear as training writes them, unbuffered.
    process = subprocess.Popen(
        command, cwd=PROJECT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    interrupts = 0
    while True:
        try:
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if chunk:
                sys.stdout.write(decoder.decode(chunk))
                sys.stdout.flush()
                continue
            status = process.wait()  # end of output: training and its workers have closed it
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                # Jupyter may have signalled the kernel's whole process group, training included; then
                # this second SIGINT is noted as a repeat and changes nothing.
                process.send_signal(signal.SIGINT)
                print("\ninterrupt: training saves a checkpoint, then stops", flush=True)
            else:
                print(
                    "\ninterrupt: already stopping, waiting for the checkpoint to be saved. To kill training "
                    "without it, restart the kernel: the run continues from its previous checkpoint.",
                    flush=True,
                )
    process.stdout.close()
    if status == 0:
        return
    if interrupts:
        raise KeyboardInterrupt(f"training stopped (exit {status}): run this cell again to continue")
    if status == EXIT_STOPPED:  # a signal from elsewhere (the platform, kill): the checkpoint is saved
        raise RuntimeError(f"training stopped (exit {status}): run this cell again to continue")
    raise RuntimeError(f"{shlex.join(command)} failed with exit status {status}: its output is above")
