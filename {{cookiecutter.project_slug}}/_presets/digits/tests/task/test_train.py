"""Real training runs on the CPU: the model learns, outputs are complete (2 processes against 1, bit for bit:
tests/test_guarantees.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoint import read_loop_state
from {{ cookiecutter.package_name }}.utils.config import load_config

from ..conftest import PROJECT, gpu_env, last_eval, read_metrics, start_line

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


# train.py as a user starts it, on a GPU of which this process may use only argv[1] bytes (0: all of it):
# PyTorch's allocator then raises its real CUDA out-of-memory error, as on a smaller or shared GPU. At
# exit it prints the most memory the run held, which sizes the limit.
LIMITED_GPU = """
import atexit, runpy, sys, torch
if int(sys.argv[1]):
    torch.cuda.set_per_process_memory_fraction(int(sys.argv[1]) / torch.cuda.mem_get_info()[1])
atexit.register(lambda: print(f"PEAK_RESERVED {torch.cuda.max_memory_reserved()}", flush=True))
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.cuda
def test_auto_batch_size_backs_off_from_a_real_cuda_out_of_memory(tmp_path: Path) -> None:
    """Hidden 4096 (about 270 MB of weights, gradients and AdamW state): the memory a per-device batch of
    512 and one of 1024 take are measured first, and the limit set halfway, so a batch of 1024 does not
    fit on any GPU. The search finds a size that fits, trains with accumulation and ends bitwise equal
    to a run configured with that size from the start."""
    args = ["--config", "configs/local.yaml", "--hidden_size", "4096", "--global_batch_size", "1024"]
    args += ["--max_steps", "3", "--mixed_precision", "bf16"]

    def train(output_dir: Path, limit: int, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", LIMITED_GPU, str(limit), *args, "--output_dir", str(output_dir)]
        env = gpu_env()
        return subprocess.run(
            [*command, *extra], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600
        )

    def peak(size: int) -> int:
        result = train(tmp_path / f"peak-{size}", 0, "--per_device_batch_size", str(size))
        assert result.returncode == 0, result.stderr[-3000:]
        return int(re.findall(r"PEAK_RESERVED (\d+)", result.stdout)[-1])

    half, whole = peak(512), peak(1024)
    assert whole - half > 40 * 2**20, f"batches of 512 and 1024 hold {half} and {whole} bytes: too close"
    limit = (half + whole) // 2

    plain = train(tmp_path / "plain", limit, "--per_device_batch_size", "1024")
    assert plain.returncode != 0 and "CUDA out of memory" in plain.stderr, plain.stderr[-3000:]
    searched = train(
        tmp_path / "searched", limit, "--per_device_batch_size", "1024", "--auto_batch_size", "true"
    )
    assert searched.returncode == 0, searched.stderr[-3000:]
    found = re.search(r"auto_batch_size: per-device batch (\d+) x (\d+) accumulation", searched.stdout)
    assert found, searched.stdout[-3000:]
    size, accumulation = int(found[1]), int(found[2])
    assert size < 1024 and size * accumulation == 1024
    configured = train(tmp_path / "configured", limit, "--per_device_batch_size", str(size))
    assert configured.returncode == 0, configured.stderr[-3000:]
    weights = [tmp_path / name / "model" / "model.safetensors" for name in ("searched", "configured")]
    assert weights[0].read_bytes() == weights[1].read_bytes()
