"""The workarounds for Accelerate's per-step costs keep Accelerate's behaviour."""

from __future__ import annotations

import accelerate.optimizer
import pytest
import torch
from accelerate import Accelerator

from {{ cookiecutter.package_name }}.utils.accelerate_fixes import cache_lomo_check


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


def test_an_accelerate_without_the_check_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(accelerate.optimizer, "is_lomo_available")
    cache_lomo_check()
    assert not hasattr(accelerate.optimizer, "is_lomo_available")
