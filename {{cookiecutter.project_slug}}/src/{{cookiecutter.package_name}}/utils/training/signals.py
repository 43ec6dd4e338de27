"""Turn SIGTERM, SIGINT, SIGUSR1, SIGHUP, or the launcher's death, into a request to stop (docs/resume.md):
recorded only; the loop acts where all processes meet, so every rank saves the same checkpoint."""

from __future__ import annotations

import atexit
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from ..machine.hardware import main_process_of_launch

# A run stopped by a signal after its checkpoint exits 75 (EX_TEMPFAIL): rerun the command to continue.
EXIT_STOPPED = 75

# A second signal of the same kind this soon after the first is the same stop: a notebook's stop button
# reaches training twice, from Jupyter (it signals the kernel's process group) and from notebook.py's relay.
SAME_PRESS_S = 1.0

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
LAUNCHER_CHECK_S = 1.0
LAUNCHER_DIED = "the launcher's death"
LAUNCHER_PID = "TRAIN_LAUNCHER_PID"  # set by launch.py: known to a process that starts after its death


class StopRequest:
    """Set by the first stop signal (or the launcher's death); later ones are ignored, so a save finishes."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._first_at = 0.0
        # Forked DataLoader workers have this handler until they ignore stop signals: it does nothing there.
        self._pid = os.getpid()
        # SLURM and the launchers signal every rank: each records it (for the stop vote), rank 0 says so.
        self._announce = main_process_of_launch()
        self._below = "\n" if sys.stdout.isatty() else ""  # the line of a progress bar (training/progress.py)
        for signum in STOP_SIGNALS:
            if not (signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN):  # nohup's stays
                signal.signal(signum, self._handle)
        self._lock = threading.Lock()  # the launcher's death is checked by two threads, said by one
        self._polled = False  # by the loop, which votes on a stop: before that, there is nothing to save
        launched = "TORCHELASTIC_RUN_ID" in os.environ  # by torch's launcher (accelerate launch, torchrun)
        self._launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid()) if launched else None  # the parent
        if self._launcher is not None:
            threading.Thread(target=self._watch, name="launcher", daemon=True).start()

    @property
    def signal_name(self) -> str | None:
        """The first stop signal's name, or LAUNCHER_DIED: checked as each process votes, so all name it."""
        self._polled = True
        self._check_launcher()
        return self._name

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:  # its terminal hung up (or a pipe's reader is gone): a write would fail
            self._quiet(hung_up)
        if self._name is None:
            self._name = name
            self._first_at = time.monotonic()
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
        if not self._polled:  # still starting: maybe waiting for ever on the launcher's rendezvous store
            os._exit(EXIT_STOPPED)

    def _check_launcher(self) -> None:
        """Once the launcher is gone (this process adopted): a stop; output not to a file: /dev/null."""
        with self._lock:
            launcher = self._launcher
            if launcher is None or os.getppid() == launcher:
                return
            self._launcher = None
        self._quiet(lambda fd: not stat.S_ISREG(os.fstat(fd).st_mode))
        if self._name is None:
            self._name = LAUNCHER_DIED
            self._say(f"the launcher (pid {launcher}) is gone: stopping, with a checkpoint if training began")

    def _quiet(self, reader_gone: Callable[[int], bool]) -> None:
        """Standard output and error to /dev/null where `reader_gone(fd)`: on to the checkpoint, unheard."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            if reader_gone(fd):
                os.dup2(devnull, fd)

    def _say(self, message: str) -> None:
        if self._announce:
            # Straight to the file descriptor: a write to sys.stderr that the signal interrupted (a progress
            # bar, wandb's console capture) would be re-entered: "reentrant call", or wandb 0.17's deadlock.
            os.write(sys.stderr.fileno(), f"{self._below}{message}\n".encode())


def hung_up(fd: int) -> bool:  # its terminal hung up, or its pipe's reader is gone
    (poller := select.poll()).register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: leave stop signals to the main process. SLURM and `kill -- -PGID`
    signal workers too, and a worker that died of it would crash the main process before its checkpoint."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def exit_process(status: int | str | None) -> NoReturn:
    """`sys.exit(status)`; in a process of a multi-process launch, without the interpreter's teardown, which a
    gloo thread that outlives the group aborts (SIGABRT, once in 100 runs; tests/test_signals.py)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        sys.exit(status)
    if isinstance(status, str):
        print(status, file=sys.stderr)
        status = 1
    # What Python's own exit runs before its teardown: non-daemon threads joined, then atexit functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
