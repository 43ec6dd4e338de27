"""Workarounds for Accelerate behaviour that slows training down, each measured by the template's bench/:
each skips work that cannot change the result, in exactly the case where it is measured; everything else
goes through Accelerate's own code.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import accelerate.accelerator
import accelerate.optimizer
import accelerate.state
import torch
from accelerate.utils import DistributedType, parse_flag_from_env

# Where Accelerator.backward is `(loss / gradient_accumulation_steps).backward()` and nothing else.
PLAIN_BACKWARD = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def speed_up_accelerate() -> None:
    cache_lomo_check()
    cache_zero_grad_check()
    skip_division_by_one()
    clip_without_dtensor_checks()
    read_fsdp_flag_once()


def cache_lomo_check() -> None:
    """Ask once per run, not twice per `AcceleratedOptimizer.step` (a search of sys.path, 0.9 ms on a 2-core
    CPU), whether lomo_optim is installed: one installed mid-run could not change the run's optimizer."""
    check = accelerate.optimizer.is_lomo_available
    if not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


@functools.cache
def takes_set_to_none(optimizer_type: type) -> bool:
    return "set_to_none" in inspect.signature(optimizer_type.zero_grad).parameters


def cache_zero_grad_check() -> None:
    """Inspect the optimizer's `zero_grad` signature once per optimizer type, not at every step as
    `AcceleratedOptimizer.zero_grad` does (about 3% of a small model's step on a 2-core CPU); then call
    `zero_grad(set_to_none=True)` as Accelerate would. Any other case goes to Accelerate's method."""
    original = accelerate.optimizer.AcceleratedOptimizer.zero_grad

    @functools.wraps(original)
    def zero_grad(self: Any, set_to_none: bool | None = None) -> None:
        syncing = self.gradient_state.sync_gradients
        if set_to_none is None and syncing and takes_set_to_none(type(self.optimizer)):
            self.optimizer.zero_grad(set_to_none=True)
        else:
            original(self, set_to_none)

    _install(accelerate.optimizer.AcceleratedOptimizer, "zero_grad", zero_grad)


def skip_division_by_one() -> None:
    """Without gradient accumulation, back-propagate the loss itself, not the loss divided by 1 (one more
    operation forward and backward, about 3% of a small model's step on a 2-core CPU; no bit changes). Only
    where Accelerate's backward is exactly that division then `loss.backward()` (PLAIN_BACKWARD, no fp16
    loss scaler, no LOMO learning rate)."""
    original = accelerate.accelerator.Accelerator.backward

    @functools.wraps(original)
    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        if (
            not kwargs
            and self.gradient_accumulation_steps == 1
            and self.scaler is None
            and self.distributed_type in PLAIN_BACKWARD
        ):
            loss.backward()
        else:
            original(self, loss, **kwargs)

    _install(accelerate.accelerator.Accelerator, "backward", backward)


def clip_without_dtensor_checks() -> None:
    """Unscale fp16 gradients, then clip with torch's clip_grad_norm_, as `Accelerator.clip_grad_norm_` does
    after walking every parameter in Python to group DTensor gradients (1.10 and newer; about 2% of a small
    model's step on a 2-core CPU). Only where no gradient can be a DTensor (no FSDP, DeepSpeed, XLA or
    parallelism config)."""
    original = accelerate.accelerator.Accelerator.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self.distributed_type in PLAIN_BACKWARD and getattr(self, "parallelism_config", None) is None:
            self.unscale_gradients()
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return original(self, parameters, max_norm, norm_type)

    _install(accelerate.accelerator.Accelerator, "clip_grad_norm_", clip_grad_norm_)


def read_fsdp_flag_once() -> None:
    """Read ACCELERATE_USE_FSDP once per process, not at every `AcceleratedOptimizer.step` (about 1% of a
    small model's step on a 2-core CPU): the launcher sets it before the process starts."""
    original = accelerate.state.GradientState.is_xla_gradients_synced
    fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP", default=False)

    def synced(self: Any) -> bool:
        return fsdp or self._is_xla_gradients_synced

    _install(accelerate.state.GradientState, "is_xla_gradients_synced", property(synced, original.fset))


def _install(owner: type, name: str, fix: Any) -> None:
    """Put `fix` (a function or a property) in place of `owner.name`, unless a fix is there already: one
    layer, however often speed_up_accelerate runs."""
    current = getattr(owner, name)
    if not getattr(getattr(current, "fget", current), "accelerate_fix", False):
        getattr(fix, "fget", fix).accelerate_fix = True
        setattr(owner, name, fix)
