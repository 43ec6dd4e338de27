"""auto_batch_size: on out-of-memory, a smaller per-device batch with more accumulation, same global batch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

from {{ cookiecutter.package_name }}.utils.memory import batch_size_candidates, fit_batch_size

from .conftest import PROJECT

# train.py with a model that runs out of memory when it trains on more than `limit` samples at once,
# as a GPU would; evaluation (no gradients) needs less memory and always fits.
SIMULATED_OOM = """
import sys
import torch
from accelerate.utils import find_batch_size
import train

def build_limited(config):
    # The task's own model, its forward limited in place: exports (a Hugging Face folder) still see it.
    model = build(config)
    forward = model.forward

    def limited(*args, **kwargs):
        if torch.is_grad_enabled() and find_batch_size([*args, *kwargs.values()]) > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return forward(*args, **kwargs)

    model.forward = limited
    return model

limit = int(sys.argv[1])
build = train.task.build_model
train.task.build_model = build_limited
sys.exit(train.main(sys.argv[2:]))
"""


def test_candidates_divide_each_process_share_of_the_global_batch() -> None:
    assert batch_size_candidates(32, 64, 1) == [32, 16, 8, 4, 2, 1]
    assert batch_size_candidates(32, 96, 2) == [24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert batch_size_candidates(5, 64, 4) == [4, 2, 1]


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_search_takes_the_largest_fitting_size_and_leaves_no_trace(accelerator: Accelerator) -> None:
    model = accelerator.prepare(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    )
    data = torch.randn(32, 4)
    tried = []

    def train_step(size: int) -> None:
        tried.append(size)
        model(data[:size]).sum().backward()  # gradients and batch-norm statistics change
        if size > 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    rng = torch.get_rng_state()
    assert fit_batch_size(accelerator, model, [32, 16, 8, 4, 2, 1], train_step) == 4
    assert tried == [32, 16, 8, 4]
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the tries did not move the random stream
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_are_not_mistaken_for_out_of_memory(accelerator: Accelerator) -> None:
    model = accelerator.prepare(nn.Linear(4, 2))

    def train_step(size: int) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fit_batch_size(accelerator, model, [8, 4], train_step)


def test_nothing_fits_says_what_to_do(accelerator: Accelerator) -> None:
    model = accelerator.prepare(nn.Linear(4, 2))

    def train_step(size: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    with pytest.raises(RuntimeError, match="out of memory even with a per-device batch of 1: use a smaller"):
        fit_batch_size(accelerator, model, [2, 1], train_step)


@pytest.mark.slow
def test_training_after_a_simulated_oom_equals_training_with_that_batch(tmp_path: Path) -> None:
    """per_device_batch_size 32 does not fit, 8 does: the run trains with 8 x 8 accumulation and ends with
    the very same weights as a run configured with 8 from the start (the search leaves no trace)."""

    def train(limit: int, output_dir: Path, *args: str) -> str:
        command = [sys.executable, "-c", SIMULATED_OOM, str(limit), "--config", "configs/local.yaml"]
        command += ["--output_dir", str(output_dir), "--max_steps", "12", "--mixed_precision", "no", *args]
        result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result.stdout

    searched = train(8, tmp_path / "searched", "--auto_batch_size", "true")
    assert "auto_batch_size: per-device batch 8 x 8 accumulation" in searched
    train(10**6, tmp_path / "configured", "--per_device_batch_size", "8")
    weights = [
        (tmp_path / name / "model" / "model.safetensors").read_bytes() for name in ("searched", "configured")
    ]
    assert weights[0] == weights[1]

    # Without the search, the same model fails as it would on a GPU that is too small.
    command = [sys.executable, "-c", SIMULATED_OOM, "8", "--config", "configs/local.yaml"]
    command += ["--output_dir", str(tmp_path / "plain"), "--max_steps", "2"]
    failed = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and "out of memory" in failed.stderr
