"""Rollback and skip (docs/resume.md, "Divergence"): one NaN training image (tests/task/poison_hook) makes a
step's loss NaN; the run goes back to the checkpoint before it, skips that data and trains on, exactly."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_problem, list_checkpoints

from ..conftest import (
    assert_same_run,
    read_metrics,
    run_training,
    sessions_of,
    start_training,
    wait_for_training,
)

pytestmark = pytest.mark.slow

POISON_HOOK = Path(__file__).parent / "poison_hook"
# 4 epochs of 22 steps; checkpoints at fixed steps alone, so that every run rolls back to the same one.
# Per-device batch 32: 1 process accumulates 2 micro-batches, 2 processes 1 each (the same kernels).
ARGS = ["--num_epochs", "4", "--log_every", "5", "--checkpoint_every", "10", "--max_time_lost", ""]
ARGS += ["--per_device_batch_size", "32"]
ROLLBACK = "rollback 1 of 3 at step 30: the train loss of steps up to 30 is nan; back to step 20"


def poison(monkeypatch: pytest.MonkeyPatch, epochs: str = "1") -> None:
    """Training image 0 is NaN in `epochs` (in epoch 1, its step is one of 26 to 30)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(POISON_HOOK), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("POISON_INDEX", "0")
    monkeypatch.setenv("POISON_EPOCHS", epochs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The poisoned run, uninterrupted, in 1 process."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        poison(monkeypatch)
        output_dir = tmp_path_factory.mktemp("reference") / "run"
        result = run_training(output_dir, *ARGS)
    assert result.stdout.count("rollback ") == 1 and ROLLBACK in result.stdout, result.stdout
    assert "done: 88 optimizer steps" in result.stdout
    return output_dir


def test_one_nan_sample_rolls_back_once_and_trains_to_the_end(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run ends its schedule after one rollback, which history.json, metrics.jsonl and the checkpoints
    record; on 2 processes it rolls back the same way and ends bitwise equal."""
    (session,) = sessions_of(reference)
    (rollback,) = session["rollbacks"]
    assert rollback["step"] == 30 and rollback["back_to"] == 20 and rollback["batches"] == [20, 40]
    rows = [row for row in read_metrics(reference) if "train/rollback" in row]
    assert rows == [{"step": 20, "train/rollback": 1, "train/rollback_of": 30}]
    for path in list_checkpoints(reference):  # whole, with the rollback in their loop state
        assert checkpoint_problem(path) is None
        assert json.loads((path / "loop_state.json").read_text())["loop_state"]["rollbacks"] == [rollback]
    poison(monkeypatch)
    two = run_training(tmp_path / "two", *ARGS, processes=2)
    assert two.stdout.count("rollback ") == 1 and ROLLBACK in two.stdout, two.stdout
    assert_same_run(tmp_path / "two", reference)


def wait_for_rollback(output_dir: Path, process: Any, step: int) -> None:
    """Until metrics.jsonl holds the rollback's row and, after it, a row of `step` or later."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        lines = (output_dir / "metrics.jsonl").read_text() if (output_dir / "metrics.jsonl").exists() else ""
        after = lines.partition('"train/rollback"')[2].splitlines()[1:]
        if any(line.endswith("}") and json.loads(line)["step"] >= step for line in after):
            return
        time.sleep(0.01)
    pytest.fail("the run did not train past its rollback")


def test_kill_9_then_sigterm_after_the_rollback_resume_exactly(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed (kill -9) after the rollback, before its next checkpoint, then that rerun stopped by SIGTERM:
    neither rerun rolls back again, and the run ends bitwise equal (one run for both ways to stop)."""
    poison(monkeypatch)
    output_dir = tmp_path / "run"
    process = start_training(output_dir, *ARGS)
    wait_for_rollback(output_dir, process, step=25)
    process.send_signal(signal.SIGKILL)
    first, _ = process.communicate(timeout=120)
    assert ROLLBACK in first and "done:" not in first, first[-2000:]
    started = time.time()
    process = start_training(output_dir, *ARGS)
    wait_for_training(output_dir, process, since=started, step=35)
    process.send_signal(signal.SIGTERM)
    second, _ = process.communicate(timeout=120)
    assert "checkpoint saved, run the same command to continue" in second, second[-2000:]
    assert "rollback " not in second and "resume differs" not in second, second[-2000:]
    resumed = run_training(output_dir, *ARGS)
    assert "rollback " not in resumed.stdout and "resume differs" not in resumed.stdout, resumed.stdout
    assert_same_run(output_dir, reference)


def test_nan_in_every_epoch_stops_after_max_rollbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every epoch from the second diverges: two rollbacks, then the third divergence stops the run as one
    does without rollbacks, in one line; no checkpoint holds a non-finite weight, nothing is exported."""
    poison(monkeypatch, "1,2,3,4,5,6,7")  # not epoch 0, which has no checkpoint before image 0
    output_dir = tmp_path / "run"
    result = run_training(output_dir, *ARGS, "--num_epochs", "8", "--max_rollbacks", "2", check=False)
    assert result.returncode == 1, result.stdout[-2000:]
    assert [line[:14] for line in result.stdout.splitlines() if line.startswith("rollback ")] == [
        "rollback 1 of ",
        "rollback 2 of ",
    ]
    (error,) = [line for line in (result.stdout + result.stderr).splitlines() if "training diverged" in line]
    assert "; rollback 3 of max_rollbacks 2: all spent." in error
    assert not (output_dir / "model").exists()
    for path in list_checkpoints(output_dir):
        assert all(torch.isfinite(t).all() for t in load_file(path / "model.safetensors").values()), path


def test_a_branch_that_rolls_back_keeps_its_learning_rate(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch with a third of the rate (--resume_from) rolls back to the checkpoint it branched from,
    saved at the old rate, and trains on at its own."""
    output_dir = tmp_path / "run"
    run_training(output_dir, *ARGS, "--max_steps", "20")
    poison(monkeypatch)
    result = run_training(output_dir, *ARGS, "--learning_rate", "0.001", "--resume_from", "20")
    assert ROLLBACK in result.stdout, result.stdout
    rates = {row["step"]: row["train/lr"] for row in read_metrics(output_dir) if "train/lr" in row}
    before = {row["step"]: row["train/lr"] for row in read_metrics(reference) if "train/lr" in row}
    assert rates.keys() == before.keys()
    for step in rates:
        assert rates[step] == (before[step] if step <= 20 else pytest.approx(before[step] / 3, rel=1e-9))
