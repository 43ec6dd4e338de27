"""The suite's plain CPU runs of train.py and predict.py, forked from one process that has imported torch
and Accelerate already (conftest.py's `run_script` decides which runs).

A fresh interpreter spends about 6 of a short run's 8 seconds importing torch (torch._dynamo among it,
which torch.optim loads), and the suite makes hundreds of such runs. A forked run is still a process of
its own, started as `python <script> <args>` is: its own pid, environment, working directory, output and
exit status, the script run from its file as `__main__`, the random generators reseeded and the thread
count read from OMP_NUM_THREADS as at a start. What stays shared is what Python and torch fix when they
start, so a run whose environment differs there (PYTHON*, TORCH*, CUDA*, OMP_NUM_THREADS unset) starts a
fresh interpreter, as do runs on a GPU, runs that are signalled (those build their own command), and runs
of several processes that may fail (`accelerate launch` reports a failure in its own way). The processes
of a run that must succeed are forked side by side, each with the environment `accelerate launch` gives
it (`launched_env`), and form one gloo group as launched ones do.

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
import socket
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
        self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float, processes: int = 1
    ) -> subprocess.CompletedProcess[str]:
        """`python <argv>`, or with `processes` > 1 `accelerate launch --multi_gpu --num_processes
        <processes> <argv>`, to its end; exit status 1 if any process failed, as the launcher's."""
        if self.process is None or self.process.poll() is not None:
            # One thread while idle: an OpenMP pool started before fork() would hang the children's.
            self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
            pipe = subprocess.PIPE
            self.process = subprocess.Popen([sys.executable, __file__], stdin=pipe, stdout=pipe, env=self.env)
        with tempfile.TemporaryDirectory(prefix="forked_run_") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            ranks = [env]
            if processes > 1:
                port = free_port()
                ranks = [launched_env(env, rank, processes, port) for rank in range(processes)]
            request = {"argv": argv, "ranks": ranks, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            out.touch(), err.touch()  # the processes append to them, each its lines, as to a shared pipe
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            pid = int(self.reply(timeout=600))  # the first request waits for the imports
            try:
                returncode = int(self.reply(timeout))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # the server then kills the others
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous's: the suite's launches take theirs here too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_env(env: dict[str, str], rank: int, processes: int, port: int) -> dict[str, str]:
    """What `accelerate launch --multi_gpu --num_processes <processes> --mixed_precision no --dynamo_backend
    no` on one machine adds to the environment of process `rank` (Accelerate 1.x through torch's elastic
    agent, as a launched process prints it), less what serves the agent alone: its store, which rank 0
    holds here, and its error files."""
    each = {"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1}
    each |= {"WORLD_SIZE": processes, "LOCAL_WORLD_SIZE": processes, "ROLE_WORLD_SIZE": processes}
    each |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ROLE_NAME": "default"}
    each |= {"TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none"}
    each |= {"TORCH_NCCL_ASYNC_ERROR_HANDLING": 1, "ACCELERATE_MIXED_PRECISION": "no"}
    signals = env.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")  # torchrun's default
    each |= {"TORCHELASTIC_SIGNALS_TO_HANDLE": signals}
    each |= {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default"}
    for name in ("DYNAMIC", "FULLGRAPH", "REGIONAL_COMPILATION"):
        each[f"ACCELERATE_DYNAMO_USE_{name}"] = "False"
    return {**env, **{name: str(value) for name, value in each.items()}}


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
            request = json.loads(line)
            pids = []
            for env in request["ranks"]:
                pid = os.fork()
                if pid == 0:
                    os.close(requests), os.close(replies)
                    run_in_child({**request, "env": env}, preamble, torch)  # ends the child
                pids.append(pid)
            os.write(replies, f"{pids[0]}\n".encode())
            os.write(replies, f"{wait_for_all(pids)}\n".encode())


def wait_for_all(pids: list[int]) -> int:
    """The exit status of one process, or of a launch of several: the first failure ends the others (as
    torch's elastic agent does) and makes it 1."""
    running, codes = set(pids), []
    while running:
        pid, status = os.waitpid(-1, 0)
        running.discard(pid)
        codes.append(os.waitstatus_to_exitcode(status))
        if codes[-1] != 0:
            for other in running:
                os.kill(other, signal.SIGKILL)
    return codes[0] if len(pids) == 1 else int(any(codes))


def run_in_child(request: dict, preamble: bytes, torch: ModuleType) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
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
