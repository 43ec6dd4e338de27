"""Real training runs on the CPU: the model learns, outputs are complete (2 processes against 1, bit for bit:
tests/test_guarantees.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import read_loop_state
from {{ cookiecutter.package_name }}.utils.config import load_config

from ..conftest import assert_same_run, last_eval, read_metrics, run_training, sessions_of, start_line

pytestmark = pytest.mark.slow


def test_short_run_learns(single_run: tuple) -> None:
    output_dir, result = single_run
    assert start_line(result.stdout)["world size"] == "1"
    # 10 classes: chance is 0.1.
    assert last_eval(output_dir)["eval/accuracy"] > 0.8


def test_metrics_log_every_event_once(single_run: tuple) -> None:
    output_dir, _ = single_run
    rows = read_metrics(output_dir)
    train_steps = [row["step"] for row in rows if "train/loss" in row]
    # 1438 train samples // 64 = 22 optimizer steps per epoch, 4 epochs, logged every 5 steps and at the end.
    assert train_steps == [*range(5, 88, 5), 88]
    eval_steps = [row["step"] for row in rows if "eval/loss" in row]
    assert eval_steps == [22, 44, 66, 88]  # once per epoch
    last_train = [row for row in rows if "train/loss" in row][-1]
    assert last_train["train/samples_seen"] == 88 * 64


def test_checkpoints_are_complete_and_rotated(single_run: tuple) -> None:
    output_dir, _ = single_run
    checkpoints = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    # Every 20 steps and at the end (88), keeping the newest 2.
    assert checkpoints == ["step_00000080", "step_00000088"]
    state = read_loop_state(output_dir / "checkpoints" / "step_00000080")
    assert (state.step, state.epoch, state.samples_seen) == (80, 3, 80 * 64)
    assert state.epoch_samples == (80 - 66) * 64  # epoch 3 started after step 66
    for name in ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "config.yaml"]:
        assert (output_dir / "checkpoints" / "step_00000080" / name).is_file(), name


def test_exported_model_reproduces_logged_accuracy_with_plain_pytorch(single_run: tuple) -> None:
    output_dir, _ = single_run
    model_dir = output_dir / "model"
    config, _ = load_config([], model_dir / "config.yaml", task.Config)
    model = task.build_model(config)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    model.eval()
    _, eval_set = task.build_datasets(config)
    inputs, labels = eval_set.tensors
    with torch.no_grad():
        accuracy = (model(inputs).argmax(dim=-1) == labels).sum().item() / len(labels)
    assert accuracy == last_eval(output_dir)["eval/accuracy"]


# A sitecustomize that makes task.loss run out of memory above $OOM_ABOVE samples, after its backward.
OOM_HOOK = Path(__file__).parent / "oom_hook"


def test_auto_batch_size_steps_down_and_trains_as_that_batch_given_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-device batch of 32 and one of 16 run out of memory, 8 fits: the run trains 8 x 8 and ends with
    the very weights and metrics of a run given 8 by hand (the failed tries left nothing behind, numpy's and
    Python's generators included), and its history records 8. On 2 processes all take the smallest size that
    fits any of them, starting from the largest that divides a process's share."""
    args = ["--max_steps", "12", "--log_every", "4", "--eval_every", "6", "--mixed_precision", "no"]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(OOM_HOOK), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OOM_ABOVE", "8")
    run_training(tmp_path / "by_hand", *args, "--per_device_batch_size", "8")  # its loss draws as well
    searched = run_training(tmp_path / "searched", *args, "--auto_batch_size", "true")
    line = "auto_batch_size: per-device batch 8 x 8 accumulation = global batch 64 (32, 16 ran out of memory)"
    assert line in searched.stdout.splitlines()
    # The start line, printed before the tries, states no per-device batch that was not trained.
    batch = "up to 32 (auto_batch_size, below) x 1 processes = global batch 64"
    assert start_line(searched.stdout)["per-device batch"] == batch
    assert_same_run(tmp_path / "searched", tmp_path / "by_hand")
    assert sessions_of(tmp_path / "searched")[-1]["per_device_batch"] == 8

    monkeypatch.setenv("OOM_ABOVE_1", "4")  # process 1 has less memory than process 0
    # Per-device 64 does not divide a process's share (32) on 2 processes: the tries start from 32.
    two_args = ["--max_steps", "2", "--per_device_batch_size", "64", "--auto_batch_size", "true"]
    two = run_training(tmp_path / "two", *two_args, processes=2)
    line = "auto_batch_size: per-device batch 4 x 8 accumulation = global batch 64 (32, 16, 8 ran out of"
    assert f"{line} memory)" in two.stdout.splitlines()
    session = sessions_of(tmp_path / "two")[-1]
    assert (session["processes"], session["per_device_batch"], session["accumulation"]) == (2, 4, 8)


def test_a_resume_keeps_the_batch_size_auto_batch_size_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 1 finds that 8 fits; session 2, on the same device and number of processes, keeps 8 without
    trying (more memory is free now: a try would find 16); session 3, on 2 processes, tries again, and the
    history says the per-device batch changed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(OOM_HOOK), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OOM_ABOVE", "8")
    args = ["--log_every", "4", "--mixed_precision", "no", "--auto_batch_size", "true"]
    run_training(tmp_path, *args, "--max_steps", "4")
    monkeypatch.setenv("OOM_ABOVE", "16")
    kept = run_training(tmp_path, *args, "--max_steps", "8").stdout.splitlines()
    line = "auto_batch_size: per-device batch 8 x 8 accumulation = global batch 64 (kept from session 1, on"
    assert f"{line} this device and number of processes)" in kept
    two = run_training(tmp_path, *args, "--max_steps", "10", processes=2).stdout
    assert "auto_batch_size: per-device batch 16 x 2 accumulation = global batch 64 (32 ran out of" in two
    assert "per-device batch 8 -> 16" in two
    assert [session["per_device_batch"] for session in sessions_of(tmp_path)] == [8, 8, 16]
