"""Stop signals: every rank records the request, one line per signal says so (rank 0's), a forked
DataLoader worker, which inherits the handler until its worker_init_fn ignores stop signals, does nothing,
a signal in the middle of a write to stderr does not write into it again, a process of a gloo job ends
without the interpreter teardown that gloo's threads can abort, and a SIGHUP whose terminal hung up (a real
pty) or whose pipe's reader is gone still ends in a checkpoint and exit 75."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_step, list_checkpoints
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import PROJECT, SIGNAL_RUN, free_port, run_training, sessions_of, training_command

# A process with the handler installed forks (as a DataLoader starts a worker) and the child gets SIGUSR1
# before anything else; then the process itself gets it. Prints the child's exit code and the request.
SCRIPT = """
import os, signal
from {{ cookiecutter.package_name }}.utils.training.signals import StopRequest

stop = StopRequest()
child = os.fork()
if child == 0:
    signal.raise_signal(signal.SIGUSR1)
    os._exit(1 if stop else 0)
_, status = os.waitpid(child, 0)
signal.raise_signal(signal.SIGUSR1)
print(os.waitstatus_to_exitcode(status), bool(stop))
"""


@pytest.mark.parametrize("rank", [None, "0", "1"])
def test_one_line_per_signal_from_rank_0_and_none_from_a_forked_worker(rank: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | ({"RANK": rank} if rank else {})
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]  # the worker ignored it; the process recorded it
    line = "SIGUSR1 received: saving a checkpoint within a second or a step, then stopping"
    assert result.stderr.splitlines() == ([] if rank == "1" else [line])


# Installs the handler, says so, and waits to be signalled.
WAITS = """
import time
from {{ cookiecutter.package_name }}.utils.training.signals import StopRequest

stop = StopRequest()
print("ready", flush=True)
time.sleep(4)
"""


def test_one_stop_button_press_that_reaches_training_twice_is_said_once() -> None:
    """Kaggle's stop button: Jupyter sends SIGINT to the kernel's process group, training included, and the
    kernel's relay (notebook.py) sends training another a moment later. One press, one line; a press a
    second later is said as a repeat."""
    process = subprocess.Popen(
        [sys.executable, "-c", WAITS],
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as the kernel's is
    )
    assert process.stdout.readline() == "ready\n"
    os.killpg(process.pid, signal.SIGINT)  # Jupyter's interrupt
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)  # the relay's
    time.sleep(1.5)
    process.send_signal(signal.SIGINT)  # a second press
    _, stderr = process.communicate(timeout=60)
    assert stderr.splitlines() == [
        "SIGINT received: saving a checkpoint within a second or a step, then stopping",
        "SIGINT received again: already stopping (kill -9 is safe too)",
    ]


# A tracker that captures the console (wandb does) replaces sys.stderr with a writer that holds a lock,
# not reentrant, while it sends the text on. The signal lands in the middle of one of its writes.
CAPTURED_STDERR = """
import os, signal, sys, threading
from {{ cookiecutter.package_name }}.utils.training.signals import StopRequest

class CapturedStderr:
    def __init__(self, stream):
        self.stream, self.lock, self.signalled = stream, threading.Lock(), False
    def write(self, text):
        if not self.lock.acquire(timeout=5):
            raise SystemExit("the handler wrote into a write it interrupted")
        try:
            if not self.signalled:
                self.signalled = True
                signal.raise_signal(signal.SIGTERM)
            return self.stream.write(text)  # the handler runs before this line's call
        finally:
            self.lock.release()
    def flush(self):
        self.stream.flush()
    def fileno(self):
        return self.stream.fileno()

stop = StopRequest()
sys.stderr = CapturedStderr(sys.stderr)
print("train: step 5/100", file=sys.stderr)
print(bool(stop))
"""


def test_a_signal_during_a_write_to_stderr_does_not_write_into_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    command = [sys.executable, "-c", CAPTURED_STDERR]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]
    assert result.stderr.splitlines() == [
        "SIGTERM received: saving a checkpoint within a second or a step, then stopping",
        "train: step 5/100",
    ]


# Rank 1 leaves a gloo job while a collective it started is still pending: when rank 0 joins it, a gloo
# thread runs a Python callback. With sys.exit that happens during the interpreter's teardown and aborts
# the process (SIGABRT, "terminate called without an active exception"), the failure a finished
# two-process run's rank 1 showed now and then.
LEAVER = """
import atexit, sys, threading, time, torch, torch.distributed as dist
from {{ cookiecutter.package_name }}.utils.training.signals import exit_process

dist.init_process_group("gloo")
tensor = torch.ones(2)
if dist.get_rank() == 1:
    atexit.register(print, "atexit functions ran")
    threading.Thread(target=lambda: (time.sleep(0.5), print("a thread's last write"))).start()
    dist.all_reduce(tensor, async_op=True).get_future().then(lambda future: future.value())
    print("rank 1 leaves")
    exit_process(sys.argv[1] if sys.argv[1] != "0" else 0)
time.sleep(2)
try:
    dist.all_reduce(tensor)
except RuntimeError:
    pass  # rank 1 is gone
"""


@pytest.mark.parametrize("status", ["0", "error: one line"])
def test_a_process_of_a_gloo_job_exits_without_the_teardown_abort(status: str) -> None:
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    command = [sys.executable, "-c", LEAVER, status]
    ranks = [
        subprocess.Popen(
            command,
            cwd=PROJECT,
            env=env | {"RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    (_, _), (out, err) = [rank.communicate(timeout=120) for rank in ranks]
    assert ranks[1].returncode == (0 if status == "0" else 1), err
    assert "terminate called" not in err
    assert out.splitlines() == ["rank 1 leaves", "a thread's last write", "atexit functions ran"]
    if status != "0":
        assert err.splitlines()[-1] == status


@pytest.mark.slow
@pytest.mark.parametrize("output", ["terminal", "pipe"])
def test_a_hangup_whose_output_is_gone_checkpoints_exits_75_and_the_rerun_resumes(
    output: str, tmp_path: Path
) -> None:
    """SIGHUP where a write to the run's output now fails. "terminal": an SSH connection drops under a
    foreground run: its terminal (a real pty: its controlling terminal, stdout and stderr) hangs up and the
    kernel sends SIGHUP; a write there fails with EIO. "pipe": `train.py 2>&1 | tee log`, tee gone first,
    then SIGHUP; a write fails with EPIPE. Either way: a checkpoint, exit 75, the history says why, and the
    rerun resumes from it."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN)
    if output == "terminal":
        pid, reader = pty.fork()  # a session of its own, the pty its controlling terminal and its output
        if pid == 0:
            os.chdir(PROJECT)
            os.execve(command[0], command, env)
        run = psutil.Process(pid)
    else:
        reader, writer = os.pipe()
        run = psutil.Popen(
            command, cwd=PROJECT, env=env, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer
        )
        os.close(writer)
    try:
        deadline = time.monotonic() + 300
        while not list_checkpoints(output_dir):  # read, as a terminal or tee does, until a checkpoint
            assert run.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline, "no checkpoint"
            if select.select([reader], [], [], 0.05)[0]:
                os.read(reader, 1 << 16)
        if output == "pipe":
            run.send_signal(signal.SIGSTOP)  # no write between tee's end and the hangup
        os.close(reader)  # the terminal hangs up: the kernel sends SIGHUP to its session
        if output == "pipe":
            run.send_signal(signal.SIGHUP)
            run.send_signal(signal.SIGCONT)
        assert run.wait(timeout=300) == EXIT_STOPPED
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            run.kill()
    (session,) = sessions_of(output_dir)
    assert session["ending"] == "stopped by SIGHUP"
    newest = list_checkpoints(output_dir)[-1]
    assert checkpoint_step(newest) == session["end_step"]
    resumed = run_training(output_dir, *SIGNAL_RUN)
    assert f"resuming from {newest}" in resumed.stdout
