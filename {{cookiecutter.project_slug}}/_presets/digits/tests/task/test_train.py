"""Real training runs on the CPU: the model learns, outputs are complete (2 processes against 1, bit for bit:
tests/test_guarantees.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoint import read_loop_state
from {{ cookiecutter.package_name }}.utils.config import load_config

from ..conftest import last_eval, read_metrics, start_line

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
