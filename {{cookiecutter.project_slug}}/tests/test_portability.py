"""What differs on other systems, checked on this machine: renames that refuse an existing folder, and a
console's Ctrl+C through the cross-platform launcher. The macos-latest leg of .github/workflows/tests.yml
runs this file, and the fast tests, on macOS itself.
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
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    LoopState,
    checkpoint_problem,
    export_model,
    list_checkpoints,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.utils.checkpoints.mirror import Mirror
from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE, SET_ASIDE
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import PROJECT, SIGNAL_RUN, read_metrics, wait_for_training


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
    config = task.Config(output_dir=str(output_dir), keep_checkpoints=2, max_rollbacks=0)  # rotation alone
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


@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_75_and_the_same_command_finishes(tmp_path: Path) -> None:
    """The cross-platform launcher, `python -m <package>.launch local`, stopped by a console's Ctrl+C
    (SIGINT) mid-run: training saves a checkpoint and the command exits 75; the same command continues
    from it to the end, and the lock is free."""
    output_dir = tmp_path / "run"
    # Short: the stop lands a logging interval after the first log, three before the end.
    log_every = int(SIGNAL_RUN[SIGNAL_RUN.index("--log_every") + 1])
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.launch", "local", *SIGNAL_RUN]
    command += ["--output_dir", str(output_dir), "--max_steps", str(4 * log_every)]
    env = {**os.environ, "SKIP_INSTALL": "1", "PYTHONUNBUFFERED": "1"}
    since = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_training(output_dir, process, since, step=log_every)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, stderr[-3000:]
    assert "stopped by SIGINT at step" in stdout, stdout[-3000:]
    stopped_at = list_checkpoints(output_dir)[-1]
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {stopped_at}" in result.stdout and "done: " in result.stdout
    train_steps = [row["step"] for row in read_metrics(output_dir) if "train/loss" in row]
    assert train_steps == sorted(set(train_steps))
    assert (output_dir / LOCK_FILE).read_bytes() == b""
