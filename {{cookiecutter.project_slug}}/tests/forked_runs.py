"""The suite's plain CPU runs of train.py and predict.py, forked from one process that has imported torch
and Accelerate already (conftest.py's `run_script` decides which runs).

A fresh interpreter spends about 6 of a short run's 8 seconds importing torch (torch._dynamo among it,
which torch.optim loads), and the suite makes hundreds of such runs. A forked run is still a process of
its own, started as `python <script> <args>` is: its own pid, environment, working directory, output and
exit status, the script run from its file as `__main__`, the random generators reseeded and the thread
count read from OMP_NUM_THREADS as at a start. What stays shared is what Python and torch fix when they
start, so a run whose environment differs there (PYTHON*, TORCH*, CUDA*, OMP_NUM_THREADS unset) starts a
fresh interpreter, as do runs on a GPU and runs a test signals as a group or through the launcher, or
whose launcher's own report it reads (those build their own command). The processes of a multi-process
run are forked side by side, each with the environment `accelerate launch` gives it (`launched_env`), and
form one gloo group as launched ones do; the first to fail ends the others as the launcher's agent does,
and a signal to a running one (conftest.py's `start_training`) goes to each, as the launcher passes it on.

    python tests/forked_runs.py [module ...]   # the server: imports PRELOAD and the modules named, then
                                               # reads one JSON request per line, answers pids then status
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
import time
from pathlib import Path
from types import ModuleType

# What Python and torch read from the environment only when they start.
START_VARIABLES = ("PYTHON", "TORCH", "CUDA", "LD_")
# The slow part of every run's start; what a task imports in every run is task_settings.IMPORTS.
PRELOAD = ("torch._dynamo", "torch._inductor", "accelerate", "safetensors.torch")  # optimizer, determinism


def start_variables(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(START_VARIABLES) and k != "PYTHONUNBUFFERED"}


class ForkServer:
    """One server per test process, started at its first run (it ends with the test process: its stdin
    closes); runs one script at a time. `imports`: what every run of this project's task imports besides
    PRELOAD (task_settings.IMPORTS)."""

    def __init__(self, imports: tuple[str, ...] = ()) -> None:
        self.imports = imports
        self.process: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.pending = b""
        self.running: ForkedRun | None = None

    def can_run(self, env: dict[str, str]) -> bool:
        started = self.env if self.process else os.environ
        # OMP_NUM_THREADS set: the child sets the thread count a start would have read from it.
        return env.get("OMP_NUM_THREADS", "").isdigit() and start_variables(env) == start_variables(started)

    def start(
        self, argv: list[str], env: dict[str, str], cwd: Path, processes: int = 1, merged: bool = True
    ) -> ForkedRun:
        """`python <argv>`, or with `processes` > 1 `accelerate launch --multi_gpu --num_processes
        <processes> <argv>`, started; its output (stdout, and stderr apart unless `merged`) is read at its
        end."""
        if self.running is not None:
            if self.running.poll() is None:  # left running by a test that failed
                self.running.kill()
                self.running.wait(timeout=60)
            for path in self.running.outputs:  # those of a run whose output no test read
                path.unlink(missing_ok=True)
        if self.process is None or self.process.poll() is not None:
            # One thread while idle: an OpenMP pool started before fork() would hang the children's.
            self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
            pipe = subprocess.PIPE
            command = [sys.executable, __file__, *self.imports]
            self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, env=self.env)
            self.pending = b""
        ranks = [env]
        if processes > 1:
            port = free_port()
            ranks = [launched_env(env, rank, processes, port) for rank in range(processes)]
        # Each process appends its lines to them, as to a shared pipe.
        outputs = [Path(tempfile.mkstemp(prefix="forked_run_")[1]) for _ in range(1 if merged else 2)]
        request = {"argv": argv, "ranks": ranks, "cwd": str(cwd), "outputs": [str(path) for path in outputs]}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        # The first request waits for the imports.
        pids = [int(pid) for pid in self.reply(timeout=600).split()]
        self.running = ForkedRun(self, [sys.executable, *argv], pids, outputs)
        return self.running

    def run(
        self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float, processes: int = 1
    ) -> subprocess.CompletedProcess[str]:
        """`start`, to its end; exit status 1 if any process failed, as the launcher's."""
        run = self.start(argv, env, cwd, processes, merged=False)
        stdout, stderr = run.communicate(timeout)
        return subprocess.CompletedProcess(run.args, run.wait(), stdout, stderr)

    def reply(self, timeout: float) -> str:
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 1024)
            if not chunk:
                raise RuntimeError(f"the fork server ended ({self.process.wait()}): see the suite's stderr")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()


class ForkedRun:
    """A forked run, used as `subprocess.Popen(command, stdout=PIPE, stderr=STDOUT, text=True)` is: a
    signal goes to each of its processes, as the launcher passes one on."""

    def __init__(self, server: ForkServer, args: list[str], pids: list[int], outputs: list[Path]) -> None:
        self.server, self.args, self.pids, self.pid, self.outputs = server, args, pids, pids[0], outputs
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(TimeoutError):
                self.returncode = int(self.server.reply(timeout=0))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self.server.reply(600 if timeout is None else timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()  # as subprocess.run does; the server then kills the others
            self.wait(timeout=60)
            raise
        # As subprocess.run(text=True) reads them: universal newlines.
        texts = [path.read_text().replace("\r\n", "\n").replace("\r", "\n") for path in self.outputs]
        for path in self.outputs:
            path.unlink(missing_ok=True)
        return texts[0], (texts[1] if len(texts) > 1 else None)


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

        for name in (*PRELOAD, *sys.argv[1:]):
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
            os.write(replies, f"{' '.join(map(str, pids))}\n".encode())
            os.write(replies, f"{wait_for_all(pids)}\n".encode())


def wait_for_all(pids: list[int]) -> int:
    """The exit status of one process, or of a launch of several: the first failure ends the others as
    torch's elastic agent does (SIGTERM, SIGKILL after 30 s) and makes it 1."""
    running, codes, deadline = set(pids), [], float("inf")
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline < float("inf") else 0)
        if pid == 0:  # waiting for the others to end
            if time.monotonic() > deadline:
                for other in running:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.01)
            continue
        running.discard(pid)
        codes.append(os.waitstatus_to_exitcode(status))
        if codes[-1] != 0 and deadline == float("inf"):
            for other in running:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 30
    return codes[0] if len(pids) == 1 else int(any(codes))


def run_in_child(request: dict, preamble: bytes, torch: ModuleType) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    outputs = request["outputs"]
    for fd, path in ((1, outputs[0]), (2, outputs[-1])):
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
