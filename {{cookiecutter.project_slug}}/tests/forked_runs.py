"""The suite's plain 1-process CPU runs of train.py and predict.py, forked from one process that has
imported torch and Accelerate already (conftest.py's `run_script` decides which runs).

A fresh interpreter spends about 6 of a short run's 8 seconds importing torch (torch._dynamo among it,
which torch.optim loads), and the suite makes hundreds of such runs. A forked run is still a process of
its own, started as `python <script> <args>` is: its own pid, environment, working directory, output and
exit status, the script run from its file as `__main__`, the random generators reseeded and the thread
count read from OMP_NUM_THREADS as at a start. What stays shared is what Python and torch fix when they
start, so a run whose environment differs there (PYTHON*, TORCH*, CUDA*, OMP_NUM_THREADS unset) starts a
fresh interpreter, as do runs with several processes, a GPU, or a signal (those build their own command).

    python tests/forked_runs.py   # the server: reads one JSON request per line, answers pid then status
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

# What Python and torch read from the environment only when they start.
START_VARIABLES = ("PYTHON", "TORCH", "CUDA", "LD_")
# The slow part of every run's start. Nothing a run may not import: utils/history.py records the versions
# of the task's libraries that are loaded (transformers, peft, ...), so those a preset uses stay its own.
PRELOAD = ("torch._dynamo", "torch._inductor", "accelerate", "safetensors.torch")  # optimizer, determinism


def start_variables(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(START_VARIABLES) and k != "PYTHONUNBUFFERED"}


class ForkServer:
    """One server per test process, started at its first run (it ends with the test process: its stdin
    closes); runs one script at a time."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def can_run(self, env: dict[str, str]) -> bool:
        started = self.env if self.process else os.environ
        # OMP_NUM_THREADS set: the child sets the thread count a start would have read from it.
        return env.get("OMP_NUM_THREADS", "").isdigit() and start_variables(env) == start_variables(started)

    def run(
        self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        if self.process is None or self.process.poll() is not None:
            # One thread while idle: an OpenMP pool started before fork() would hang the children's.
            self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
            pipe = subprocess.PIPE
            self.process = subprocess.Popen([sys.executable, __file__], stdin=pipe, stdout=pipe, env=self.env)
        with tempfile.TemporaryDirectory(prefix="forked_run_") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            pid = int(self.reply(timeout=600))  # the first request waits for the imports
            try:
                returncode = int(self.reply(timeout))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self.reply(timeout=60)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
            # As subprocess.run(text=True) reads them: universal newlines.
            texts = [path.read_text().replace("\r\n", "\n").replace("\r", "\n") for path in (out, err)]
        return subprocess.CompletedProcess([sys.executable, *argv], returncode, *texts)

    def reply(self, timeout: float) -> str:
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError
            byte = os.read(self.process.stdout.fileno(), 1)
            if not byte:
                raise RuntimeError(f"the fork server ended ({self.process.wait()}): see the suite's stderr")
            line += byte
        return line.decode()


def serve() -> None:
    """Import what every run imports, then fork one child per request."""
    requests, replies, stderr = os.dup(0), os.dup(1), os.dup(2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    with tempfile.TemporaryFile() as printed:  # what the imports print (a warning), each run prints first
        os.dup2(printed.fileno(), 1), os.dup2(printed.fileno(), 2)
        import torch

        for name in PRELOAD:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(stderr, 1), os.dup2(stderr, 2)
        printed.seek(0)
        preamble = printed.read()

    pending = b""
    while chunk := os.read(requests, 1 << 16):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                os.close(requests), os.close(replies)
                run_in_child(json.loads(line), preamble, torch)  # ends the child
            os.write(replies, f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def run_in_child(request: dict, preamble: bytes, torch: ModuleType) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True
    )
    os.write(2, preamble)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # as OpenMP reads it at a start
    random.seed()
    torch.seed()
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:  # as the interpreter reports an uncaught one
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    serve()
