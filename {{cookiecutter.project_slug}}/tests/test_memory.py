"""auto_batch_size (utils/machine/memory.py): a try that ran out of memory leaves nothing behind."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.machine.memory import fit_batch_size


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_tries_leave_no_gradient_statistic_or_random_draw(
    accelerator: Accelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 32 and 16 run out of memory after their backward (BatchNorm's statistics, dropout's and the
    loss's numpy and Python draws moved, gradients left), 8 fits: 8 x 8 accumulation, and the model and
    every generator as they were."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    samples = list(torch.randn(32, 4))
    tried = []

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        tried.append(len(batch))
        value = model(batch).square().mean() * (1 + np.random.rand() + random.random())
        if len(batch) > 8:
            value.backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return value

    monkeypatch.setattr(task, "collate", torch.stack)
    monkeypatch.setattr(task, "loss", loss)
    config = task.Config(per_device_batch_size=32, global_batch_size=64, auto_batch_size=True)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    random_state = torch.get_rng_state()
    numpy_state, python_state = np.random.get_state(), random.getstate()
    fit_batch_size(accelerator, config, model, samples, None)
    assert tried == [32, 16, 8]
    assert (config.per_device_batch_size, accelerator.gradient_accumulation_steps) == (8, 8)
    assert torch.equal(torch.get_rng_state(), random_state)
    assert all(np.array_equal(now, was) for now, was in zip(np.random.get_state(), numpy_state, strict=True))
    assert random.getstate() == python_state
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert all(param.grad is None for param in model.parameters())

    def other_error(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(task, "loss", other_error)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # not taken for out of memory
        fit_batch_size(accelerator, config, model, samples, None)
