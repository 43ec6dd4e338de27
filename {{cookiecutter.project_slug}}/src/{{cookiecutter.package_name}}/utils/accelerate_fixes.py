"""Workarounds for Accelerate behaviour that slows training down, each measured by the template's bench/.

Each one skips work that cannot change the result, in exactly the case where it is measured; everything
else goes through Accelerate's own code. `speed_up_accelerate()` applies all of them, once per process.
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
    """Ask once per run whether lomo_optim is installed: `AcceleratedOptimizer.step` asks twice per step,
    each a search of sys.path (0.9 ms on a 2-core CPU, a third of a small model's step). A package
    installed halfway through a run could not change its optimizer: the cached answer is the right one."""
    check = accelerate.optimizer.is_lomo_available
    if not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


@functools.cache
def takes_set_to_none(optimizer_type: type) -> bool:
    return "set_to_none" in inspect.signature(optimizer_type.zero_grad).parameters


def cache_zero_grad_check() -> None:
    """Inspect the optimizer's `zero_grad` signature once per optimizer type, not at every step as
    `AcceleratedOptimizer.zero_grad` does to know whether it takes `set_to_none` (about 3% of a small
    model's step on a 2-core CPU). Where it does (every torch optimizer), Accelerate then calls
    `zero_grad(set_to_none=True)`, as the fast path does; any other case goes to Accelerate's method."""
    optimizer_class = accelerate.optimizer.AcceleratedOptimizer
    original = optimizer_class.zero_grad
    if getattr(original, "skips_the_signature", False):
        return

    @functools.wraps(original)
    def zero_grad(self: Any, set_to_none: bool | None = None) -> None:
        syncing = self.gradient_state.sync_gradients
        if set_to_none is None and syncing and takes_set_to_none(type(self.optimizer)):
            self.optimizer.zero_grad(set_to_none=True)
        else:
            original(self, set_to_none)

    zero_grad.skips_the_signature = True
    optimizer_class.zero_grad = zero_grad


def skip_division_by_one() -> None:
    """Without gradient accumulation, back-propagate the loss itself: `Accelerator.backward` divides it by
    1, one more operation forward and backward per micro-batch (about 3% of a small model's step on a
    2-core CPU; on a GPU, two more kernel launches) that changes no bit. Skipped only where Accelerate's
    backward is exactly that division then `loss.backward()` (no DeepSpeed, Megatron or XLA, no fp16 loss
    scaler, no LOMO learning rate)."""
    accelerator_class = accelerate.accelerator.Accelerator
    original = accelerator_class.backward
    if getattr(original, "skips_division_by_one", False):
        return

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

    backward.skips_division_by_one = True
    accelerator_class.backward = backward


def clip_without_dtensor_checks() -> None:
    """Unscale fp16 gradients, then clip with torch's clip_grad_norm_, where no gradient can be a DTensor
    (no FSDP, DeepSpeed, XLA or parallelism config): the same call as `Accelerator.clip_grad_norm_`'s, which
    (1.10 and newer) first walks every parameter in Python at every step to group DTensor gradients by
    device mesh (about 2% of a small model's step on a 2-core CPU, and Python that keeps a GPU waiting)."""
    accelerator_class = accelerate.accelerator.Accelerator
    original = accelerator_class.clip_grad_norm_
    if getattr(original, "skips_dtensor_checks", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self.distributed_type in PLAIN_BACKWARD and getattr(self, "parallelism_config", None) is None:
            self.unscale_gradients()
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return original(self, parameters, max_norm, norm_type)

    clip_grad_norm_.skips_dtensor_checks = True
    accelerator_class.clip_grad_norm_ = clip_grad_norm_


def read_fsdp_flag_once() -> None:
    """Read ACCELERATE_USE_FSDP once per process: `AcceleratedOptimizer.step` parses it at every step, in
    `GradientState.is_xla_gradients_synced` (about 1% of a small model's step on a 2-core CPU; it matters on
    XLA only), and the launcher sets it before the process starts, so it cannot change within a run."""
    state_class = accelerate.state.GradientState
    original = state_class.is_xla_gradients_synced
    if getattr(original.fget, "reads_the_flag_once", False):
        return
    fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP", default=False)

    def synced(self: Any) -> bool:
        return fsdp or self._is_xla_gradients_synced

    synced.reads_the_flag_once = True
    state_class.is_xla_gradients_synced = property(synced, original.fset)
