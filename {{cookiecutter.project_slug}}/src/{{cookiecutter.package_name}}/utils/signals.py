"""Turn SIGTERM, SIGINT, SIGUSR1 and SIGHUP (a closed terminal), or the launcher's death, into a request to
stop cleanly (docs/resume.md, "Signals"). The handler only records it: the loop acts on it where all
processes meet, so every rank finishes the same step and saves the same checkpoint."""

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
# The project's launcher's pid, which it sets (launch.py): a worker that starts after its death still knows
# it, where os.getppid() would name the process that adopted the worker.
LAUNCHER_PID = "TRAIN_LAUNCHER_PID"


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
        self._launcher = None
        self._lock = threading.Lock()  # the launcher's death is checked by two threads, said by one
        self._polled = False  # by the loop, which votes on a stop: before that, there is nothing to save
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self._launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid())
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
        if signum == signal.SIGHUP:  # its terminal is gone (hung up), or a pipe's reader: a write would fail
            self._quiet(lambda fd: os.isatty(fd) or hung_up(fd))
        if self._name is None:
            self._name, self._first_at = name, time.monotonic()
            message = f"{name} received: finishing the current step, then saving a checkpoint"
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
        """Once the launcher is gone (another process adopted this one, on Linux and macOS): a stop, and the
        output to its terminal or pipe, whose reader died with it (a write would fail), to /dev/null."""
        with self._lock:
            launcher = self._launcher
            if launcher is None or os.getppid() == launcher:
                return
            self._launcher = None
        self._quiet(lambda fd: not stat.S_ISREG(os.fstat(fd).st_mode))
        if self._name is None:
            self._name = LAUNCHER_DIED
            then = "finishing the step, then saving a checkpoint" if self._polled else "ending (no step yet)"
            self._say(f"the launcher (pid {launcher}) is gone: {then}")

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


def hung_up(fd: int) -> bool:
    """Whether the terminal of `fd` hung up, or its pipe's reader is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


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
