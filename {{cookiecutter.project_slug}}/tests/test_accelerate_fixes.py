"""The workarounds for Accelerate's per-step costs keep Accelerate's behaviour."""

from __future__ import annotations

import inspect

import accelerate.optimizer
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.utils import GradientAccumulationPlugin

from {{ cookiecutter.package_name }}.utils.machine import accelerate_fixes
from {{ cookiecutter.package_name }}.utils.machine.accelerate_fixes import cache_lomo_check, speed_up_accelerate


def test_the_optimizer_asks_for_lomo_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def is_lomo_available() -> bool:
        asked.append(True)
        return False

    monkeypatch.setattr(accelerate.optimizer, "is_lomo_available", is_lomo_available)
    cache_lomo_check()
    cache_lomo_check()  # a second call (a second run in the same process) does not wrap it again
    model = torch.nn.Linear(4, 2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(asked) == 1, f"asked {len(asked)} times in 3 optimizer steps"
    assert not torch.equal(model.weight, before), "the optimizer stopped stepping"


def gradients_after(accumulation: int, fast: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The gradients of two micro-batches through Accelerator.backward, clipped (to a norm they exceed)
    through Accelerator.clip_grad_norm_, and their norm before; with or without the fixes."""
    if not fast:  # Accelerate's own methods, as before speed_up_accelerate() patched them
        for cls, name in (
            (Accelerator, "backward"),
            (accelerate.optimizer.AcceleratedOptimizer, "zero_grad"),
            (Accelerator, "clip_grad_norm_"),
        ):
            monkeypatch.setattr(cls, name, inspect.unwrap(getattr(cls, name)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    inputs = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    for micro in inputs:
        with accelerator.accumulate(model):
            accelerator.backward(model(micro).square().mean())
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
    return [norm, *(param.grad.clone() for param in model.parameters())]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_fast_paths_give_accelerates_gradients_bit_for_bit(
    accumulation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    speed_up_accelerate()
    with monkeypatch.context() as original:
        expected = gradients_after(accumulation, fast=False, monkeypatch=original)
    actual = gradients_after(accumulation, fast=True, monkeypatch=monkeypatch)
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got, want)


def test_no_division_by_one_and_zero_grad_inspects_once(monkeypatch: pytest.MonkeyPatch) -> None:
    speed_up_accelerate()
    speed_up_accelerate()  # applied twice: still one layer each
    for method in (Accelerator.backward, accelerate.optimizer.AcceleratedOptimizer.zero_grad):
        assert method.__wrapped__ is inspect.unwrap(method)
    divisions, inspected = [], []
    true_divide = torch.Tensor.__truediv__
    monkeypatch.setattr(torch.Tensor, "__truediv__", lambda t, o: divisions.append(o) or true_divide(t, o))
    signature = inspect.signature
    monkeypatch.setattr(accelerate_fixes.inspect, "signature", lambda f: inspected.append(f) or signature(f))
    accelerate_fixes.takes_set_to_none.cache_clear()
    model = torch.nn.Linear(4, 2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        accelerator.backward(model(torch.ones(1, 4)).sum())
        assert model.weight.grad is not None
        optimizer.step()
        optimizer.zero_grad()
        assert model.weight.grad is None  # set_to_none=True, as Accelerate does
    assert divisions == [] and len(inspected) == 1


def test_the_fsdp_flag_is_read_once_and_the_xla_state_still_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """After speed_up_accelerate, GradientState.is_xla_gradients_synced no longer reads the environment
    (which the launcher sets before the process starts); its setter still works."""
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    speed_up_accelerate()
    state = GradientState()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    state.is_xla_gradients_synced = False
    assert state.is_xla_gradients_synced is False
    state.is_xla_gradients_synced = True
    assert state.is_xla_gradients_synced is True
