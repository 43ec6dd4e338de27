"""Workarounds for Accelerate behaviour that slows training down, each measured by the template's bench/."""

from __future__ import annotations

import functools

import accelerate.optimizer


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
