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
from accelerate.utils import DistributedType

# Where Accelerator.backward is `(loss / gradient_accumulation_steps).backward()` and nothing else.
PLAIN_BACKWARD = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def speed_up_accelerate() -> None:
    cache_lomo_check()
    cache_zero_grad_check()
    skip_division_by_one()


def cache_lomo_check() -> None:
    """Ask once per run, not twice per optimizer step, whether the lomo_optim package is installed.

    Accelerate's `AcceleratedOptimizer.step` calls `is_lomo_available()` on every step, and each call
    searches sys.path with importlib: about 0.9 ms per step on a 2-core CPU, a third of a small
    model's step. Installing a package halfway through a run could not change this run's optimizer,
    so the cached answer is the right one. Versions of Accelerate without the check are left alone.
    """
    check = getattr(accelerate.optimizer, "is_lomo_available", None)
    if check is not None and not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


@functools.cache
def takes_set_to_none(optimizer_type: type) -> bool:
    return "set_to_none" in inspect.signature(optimizer_type.zero_grad).parameters


def cache_zero_grad_check() -> None:
    """Inspect the optimizer's `zero_grad` signature once per optimizer type, not at every step.

    `AcceleratedOptimizer.zero_grad` calls `inspect.signature` on the wrapped optimizer's `zero_grad`
    each time, to know whether it takes `set_to_none`: about 3% of a small model's step on a 2-core CPU.
    Where it does (every torch optimizer), Accelerate then calls `zero_grad(set_to_none=True)`, which is
    what the fast path does; any other case goes to Accelerate's method.
    """
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
    """Without gradient accumulation, back-propagate the loss itself rather than `loss / 1`.

    `Accelerator.backward` divides the loss by the accumulation steps even when they are 1: one more
    operation forward and one backward at every micro-batch (about 3% of a small model's step on a
    2-core CPU; on a GPU, two more kernel launches). Dividing by 1 changes no bit of the loss or of the
    gradients. Only where Accelerate's backward is exactly that division then `loss.backward()` (no
    DeepSpeed, Megatron or XLA, no fp16 loss scaler, no LOMO learning rate) is it skipped.
    """
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
