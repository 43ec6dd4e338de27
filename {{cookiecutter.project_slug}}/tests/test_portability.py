"""Windows and macOS: what differs there, checked on this machine.

On Linux these tests stand in for a real Windows run: they hide what Windows lacks (SIGUSR1 and the
other POSIX-only modules and names) or give a function Windows's behaviour (a rename onto an existing
folder fails), then run the project's real code. The windows-latest and macos-latest legs of
.github/workflows/tests.yml run this file, and the fast tests, on those systems themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils import hardware
from {{ cookiecutter.package_name }}.utils.checkpoint import (
    LoopState,
    checkpoint_problem,
    export_model,
    list_checkpoints,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.utils.mirror import Mirror
from {{ cookiecutter.package_name }}.utils.run_dir import LOCK_FILE, SET_ASIDE
from {{ cookiecutter.package_name }}.utils.signals import EXIT_STOPPED

from .conftest import PROJECT, read_metrics, wait_for_training
from .task_settings import SIGNAL_RUN

# What Windows lacks, hidden before anything of the project is imported. The libraries are imported
# first, as they load on this Linux: they pick their POSIX modules by sys.platform, which this stand-in
# leaves as it is (huggingface_hub's terminal helpers, which Accelerate loads, import termios).
WINDOWS_LACKS = """
import os, signal, sys
import accelerate, huggingface_hub.utils, psutil  # libraries with a Windows backend of their own
for name in ("termios", "tty", "pty", "resource", "pwd", "grp", "syslog"):  # fcntl: the lock needs it
    sys.modules[name] = None
for module, names in (
    (signal, ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGKILL", "SIGALRM", "SIGCHLD")),
    (os, ("fork", "killpg", "getpgid", "setsid", "pread", "pwrite", "sysconf", "getuid")),
):
    for name in names:
        if hasattr(module, name):
            delattr(module, name)
"""


def run_python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=PROJECT, capture_output=True, text=True, timeout=120
    )


def test_no_module_needs_a_posix_only_name_at_import() -> None:
    """Every module of the package, train.py and predict.py import with termios, SIGUSR1, os.pread,
    os.sysconf, ... gone, as on Windows. (A module that names one in a function is fine: it is only called
    where the name exists.)"""
    script = (
        WINDOWS_LACKS
        + """
import importlib, pkgutil, runpy
import {{ cookiecutter.package_name }} as package
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(module.name)
runpy.run_path("train.py", run_name="imported")
runpy.run_path("predict.py", run_name="imported")
print("imported")
"""
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["imported"]


def test_stop_signals_where_sigusr1_does_not_exist() -> None:
    """Without SIGUSR1 (Windows), the stop signals are those the system has, and Ctrl+C (SIGINT) is still
    a stop request, said once; Ctrl+Break (SIGBREAK) on Windows too."""
    script = (
        WINDOWS_LACKS
        + """
from {{ cookiecutter.package_name }}.utils.signals import STOP_SIGNALS, StopRequest
stop = StopRequest()
for signum in STOP_SIGNALS:
    if signum != signal.SIGTERM:  # SIGTERM is TerminateProcess on Windows: no handler runs
        signal.raise_signal(signum)
print(*(signal.Signals(signum).name for signum in STOP_SIGNALS), stop.signal_name)
"""
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = ["SIGTERM", "SIGINT", *(["SIGBREAK"] if hasattr(signal, "SIGBREAK") else [])]
    assert result.stdout.split() == [*expected, "SIGINT"]
    lines = result.stderr.splitlines()
    assert lines[0] == "SIGINT received: finishing the current step, then saving a checkpoint"
    assert lines[1:] == [
        f"{name} received again: already stopping (kill -9 is safe too)" for name in expected[2:]
    ]


@pytest.fixture
def windows_renames(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.replace and os.rename as on Windows: a folder cannot take the place of an existing path
    (PermissionError, WinError 5), and os.rename replaces nothing (FileExistsError). Returns the calls."""
    calls: list[str] = []
    replace, rename = os.replace, os.rename

    def windows_replace(source, target, *args, **kwargs) -> None:
        calls.append(f"replace {Path(source).name} -> {Path(target).name}")
        if os.path.isdir(source) and os.path.exists(target):
            raise PermissionError(13, "Access is denied", str(target))
        replace(source, target, *args, **kwargs)

    def windows_rename(source, target, *args, **kwargs) -> None:
        calls.append(f"rename {Path(source).name} -> {Path(target).name}")
        if os.path.exists(target):
            raise FileExistsError(17, "Cannot create a file when that file already exists", str(target))
        rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", windows_replace)
    monkeypatch.setattr(os, "rename", windows_rename)
    return calls


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_publishing_never_renames_onto_an_existing_folder(
    windows_renames: list[str], accelerator: Accelerator, tmp_path: Path
) -> None:
    """With Windows's renames: a checkpoint saved again at a step that exists (the stranger there is set
    aside first), rotation, an export that replaces the previous one, and the mirror's copies of both,
    a second time over its first: all publish, and every checkpoint reads back whole."""
    output_dir, mirror_dir = tmp_path / "run", tmp_path / "mirror"
    config = task.Config(output_dir=str(output_dir), keep_checkpoints=2)
    model = task.build_model(config)  # the task's own: its export (a Hugging Face folder, say) runs
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    first = save_checkpoint(accelerator, config, LoopState(step=2))
    again = save_checkpoint(accelerator, config, LoopState(step=2, samples_seen=64))
    assert again == first and checkpoint_problem(again) is None
    assert [path.name for path in list_checkpoints(output_dir)] == [first.name]
    (set_aside,) = (output_dir / SET_ASIDE).glob(f"*/checkpoints/{first.name}")
    assert checkpoint_problem(set_aside) is None  # the earlier one, kept whole
    save_checkpoint(accelerator, config, LoopState(step=4))
    for step in (4, 6):  # the second export replaces the first; rotation removes step 2
        export_model(accelerator, model, config, output_dir / "model", {"step": step})
        save_checkpoint(accelerator, config, LoopState(step=step + 2))
        mirror = Mirror(output_dir, str(mirror_dir), keep=2, enabled=True)
        mirror.start("", start_over=False)
        mirror.finish()
        assert mirror.newest_step == step + 2
        for folder in (output_dir, mirror_dir):
            assert f'"step": {step}' in (folder / "model" / "export.json").read_text()
            assert all(checkpoint_problem(path) is None for path in list_checkpoints(folder))
    assert [path.name for path in list_checkpoints(output_dir)] == ["step_00000006", "step_00000008"]
    assert any(call.startswith("replace .incomplete_model -> model") for call in windows_renames)


def test_apple_silicon_trains_in_float32_and_keeps_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On MPS `mixed_precision: auto` is `no`, with the reason for the start line, and a choice of yours is
    kept; hiding the GPUs from a CPU run touches CUDA's variable only; deterministic kernels come with a
    warning naming the MPS kernels that are not (MPS is pretended available here)."""
    monkeypatch.setattr(hardware, "mps_usable", lambda: True)
    precision, why = hardware.resolve_mixed_precision("auto")
    assert precision == "no" and why.startswith("auto: Apple silicon (MPS): float32"), why
    assert hardware.resolve_mixed_precision("bf16") == ("bf16", "as configured")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hardware.hide_gpus_from_cpu_run()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    # deterministic: true on MPS names the kernels that add in no fixed order there; elsewhere, nothing.
    (warning,) = hardware.mps_determinism_warnings("mps", deterministic=True)
    assert "embedding's backward pass, index_add and index_put" in warning
    assert "ACCELERATE_USE_CPU=1" in warning
    assert hardware.mps_determinism_warnings("mps", deterministic=False) == []
    assert hardware.mps_determinism_warnings("cpu", deterministic=True) == []


@pytest.mark.slow
def test_ctrl_c_or_ctrl_break_checkpoints_exits_75_and_the_same_command_finishes(tmp_path: Path) -> None:
    """The cross-platform launcher, `python -m <package>.launch local`, stopped by a console's stop key
    mid-run: Ctrl+C (SIGINT) here and on macOS, Ctrl+Break (CTRL_BREAK_EVENT to the run's process group,
    the launcher's and training's) on Windows. Training saves a checkpoint and the command exits 75; the
    same command continues from it to the end, and the lock is free."""
    output_dir = tmp_path / "run"
    # Short: the stop lands a logging interval after the first log, three before the end.
    log_every = int(SIGNAL_RUN[SIGNAL_RUN.index("--log_every") + 1])
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.launch", "local", *SIGNAL_RUN]
    command += ["--output_dir", str(output_dir), "--max_steps", str(4 * log_every)]
    env = {**os.environ, "SKIP_INSTALL": "1", "PYTHONUNBUFFERED": "1"}
    windows = sys.platform == "win32"
    group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if windows else {}
    since = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **group
    )
    wait_for_training(output_dir, process, since, step=log_every)
    process.send_signal(signal.CTRL_BREAK_EVENT if windows else signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, stderr[-3000:]
    name = "SIGBREAK" if windows else "SIGINT"
    assert f"stopped by {name} at step" in stdout, stdout[-3000:]
    stopped_at = list_checkpoints(output_dir)[-1]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {stopped_at}" in result.stdout and "done: " in result.stdout
    train_steps = [row["step"] for row in read_metrics(output_dir) if "train/loss" in row]
    assert train_steps == sorted(set(train_steps))
    assert (output_dir / LOCK_FILE).read_bytes() == b""
