"""Workarounds for Accelerate's slow paths (measured: the template's docs/benchmarks.md): each skips work that
cannot change the result, where it is measured; everything else goes through Accelerate's own code."""

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
    """Ask once per run, not twice per `AcceleratedOptimizer.step` (a sys.path search), for lomo_optim."""
    check = accelerate.optimizer.is_lomo_available
    if not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


@functools.cache
def takes_set_to_none(optimizer_type: type) -> bool:
    return "set_to_none" in inspect.signature(optimizer_type.zero_grad).parameters


def cache_zero_grad_check() -> None:
    """Inspect the optimizer's `zero_grad` signature once per optimizer type, not at every step as
    `AcceleratedOptimizer.zero_grad` does; then call `zero_grad(set_to_none=True)` as Accelerate would."""
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
    """Without gradient accumulation, back-propagate the loss itself, not the loss divided by 1 (no bit
    changes), where Accelerate's backward is just that division then `loss.backward()` (no fp16 scaler)."""
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
    after grouping DTensor gradients in Python: only where none can be one (no FSDP, DeepSpeed, XLA)."""
    original = accelerate.accelerator.Accelerator.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self.distributed_type in PLAIN_BACKWARD and getattr(self, "parallelism_config", None) is None:
            self.unscale_gradients()
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return original(self, parameters, max_norm, norm_type)

    _install(accelerate.accelerator.Accelerator, "clip_grad_norm_", clip_grad_norm_)


def read_fsdp_flag_once() -> None:
    """Read ACCELERATE_USE_FSDP (set by the launcher) once per process, not at every optimizer step."""
    original = accelerate.state.GradientState.is_xla_gradients_synced
    fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP", default=False)

    def synced(self: Any) -> bool:
        return fsdp or self._is_xla_gradients_synced

    _install(accelerate.state.GradientState, "is_xla_gradients_synced", property(synced, original.fset))


def _install(owner: type, name: str, fix: Any) -> None:
    """Put `fix` (a function or a property) in place of `owner.name`, once however often it is asked."""
    current = getattr(owner, name)
    if not getattr(getattr(current, "fget", current), "accelerate_fix", False):
        getattr(fix, "fget", fix).accelerate_fix = True
        setattr(owner, name, fix)
