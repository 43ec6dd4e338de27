"""Turn SIGTERM, SIGINT, SIGUSR1 and SIGHUP (a closed terminal), or the launcher's death, into a request to
stop cleanly (docs/resume.md, "Signals"). The handler only records it: the loop acts on it where all
processes meet, so every rank finishes the same step and saves the same checkpoint."""

from __future__ import annotations

import atexit
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from .hardware import main_process_of_launch

# Exit status of a run that stopped on a signal after saving a checkpoint: rerun the same command
# to continue. 75 is EX_TEMPFAIL ("try again later").
EXIT_STOPPED = 75

# A second signal of the same kind this soon after the first is the same stop: a notebook's stop button
# reaches training twice, from Jupyter (it signals the kernel's process group) and from notebook.py's relay.
SAME_PRESS_S = 1.0

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
LAUNCHER_CHECK_S = 1.0
LAUNCHER_DIED = "the launcher's death"


class StopRequest:
    """Set by the first stop signal (or the launcher's death); later ones are ignored, so a save finishes."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._first_at = 0.0
        # DataLoader workers are forked with this handler and ignore stop signals only once started
        # (ignore_stop_signals); until then it must do nothing in them.
        self._pid = os.getpid()
        # SLURM and the launchers signal every rank: each records the request (the stop vote needs it
        # from one at least), rank 0 alone says so.
        self._announce = main_process_of_launch()
        self._below = "\n" if sys.stdout.isatty() else ""  # the line of a progress bar (utils/progress.py)
        for signum in STOP_SIGNALS:
            if not (signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN):  # nohup's stays
                signal.signal(signum, self._handle)
        # Started by torch's launcher (accelerate launch, torchrun): it is the parent.
        self._launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        if self._launcher is not None:
            threading.Thread(target=self._watch, name="launcher", daemon=True).start()

    @property
    def signal_name(self) -> str | None:
        """The first stop signal's name, or LAUNCHER_DIED: checked as each process votes, so all name it."""
        self._check_launcher()
        return self._name

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:  # its terminal is gone: a write there would fail (EIO)
            self._quiet(os.isatty)
        if self._name is None:
            self._name, self._first_at = name, time.monotonic()
            message = f"{name} received: saving a checkpoint within a second or a step, then stopping"
        elif name == self._name and time.monotonic() - self._first_at < SAME_PRESS_S:
            return  # one press that reached training twice (see SAME_PRESS_S)
        else:
            message = f"{name} received again: already stopping (kill -9 is safe too)"
        self._say(message)

    def _watch(self) -> None:
        while self._launcher is not None:
            time.sleep(LAUNCHER_CHECK_S)
            self._check_launcher()

    def _check_launcher(self) -> None:
        """Once the launcher is gone (another process adopted this one, on Linux and macOS): a stop, and the
        output to its terminal or pipe, whose reader died with it (a write would fail), to /dev/null."""
        launcher = self._launcher
        if launcher is None or os.getppid() == launcher:
            return
        self._launcher = None
        self._quiet(lambda fd: not stat.S_ISREG(os.fstat(fd).st_mode))
        if self._name is None:
            self._name = LAUNCHER_DIED
            self._say(f"the launcher (pid {launcher}) is gone: checkpointing within seconds, then stopping")

    def _quiet(self, reader_gone: Callable[[int], bool]) -> None:
        """Standard output and error to /dev/null where `reader_gone(fd)`: on to the checkpoint, unheard."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            if reader_gone(fd):
                os.dup2(devnull, fd)

    def _say(self, message: str) -> None:
        if self._announce:
            # Straight to the file descriptor: the signal may land while the main thread is inside a write
            # to sys.stderr (a progress bar, or a tracker that captures the console, like wandb), and a
            # second write from here would re-enter it: Python raises "reentrant call", and wandb 0.17
            # deadlocks on its own socket, so the run hangs instead of saving its checkpoint.
            os.write(sys.stderr.fileno(), f"{self._below}{message}\n".encode())


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: leave stop signals to the main process. SLURM and `kill -- -PGID`
    signal workers too, and a worker that died of it would crash the main process before its checkpoint."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def exit_process(status: int | str | None) -> NoReturn:
    """End the process as `sys.exit(status)` would (a string goes to stderr, with status 1); in a process
    of a multi-process launch, without Python's interpreter teardown: a gloo worker thread that outlives the
    group and needs the interpreter while it is torn down aborts the process (SIGABRT, about once in 100
    two-process runs; tests/test_signals.py), and the launcher reports a finished run as failed."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        sys.exit(status)
    if isinstance(status, str):
        print(status, file=sys.stderr)
        status = 1
    # What Python's own exit runs before its teardown, in its order: threads that are not daemons are
    # joined (a library's last write), then the atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
