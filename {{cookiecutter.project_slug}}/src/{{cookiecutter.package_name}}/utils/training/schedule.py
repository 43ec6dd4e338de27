"""The learning-rate schedule: its plan in optimizer steps and its factor per step (docs/configuration.md)."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..config import TrainConfig


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to zero at `total_steps`, as a LambdaLR factor."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def warmup_stable_decay(warmup_steps: int, total_steps: int, decay_start: int) -> Callable[[int], float]:
    """Linear warmup, the peak until `decay_start`, then linear decay to zero at `total_steps`: the steps
    before the decay do not depend on `total_steps`, so a longer plan continues from there exactly."""
    decay = max(1, total_steps - decay_start)
    return lambda step: min(1.0, (step + 1) / max(1, warmup_steps), (total_steps - step) / decay)


def schedule_factor(config: TrainConfig, planned: int) -> Callable[[int], float]:
    """The lr_schedule's LambdaLR factor, for a plan of `planned` optimizer steps."""
    if config.lr_schedule == "wsd":
        return warmup_stable_decay(config.warmup_steps, planned, decay_start(config, planned))
    return warmup_cosine(config.warmup_steps, planned)


def planned_steps(config: TrainConfig, steps_per_epoch: int) -> int:
    """The steps the schedule is planned for: the epochs' (max_steps for a stream, and for wsd if sooner)."""
    planned = steps_per_epoch * config.num_epochs if steps_per_epoch else config.max_steps
    return min(planned, config.max_steps) if config.lr_schedule == "wsd" and config.max_steps else planned


def decay_start(config: TrainConfig, planned_steps: int) -> int:
    """The step where a wsd schedule of `planned_steps` begins its decay (-1: not wsd)."""
    if config.lr_schedule != "wsd":
        return -1
    return max(config.warmup_steps, planned_steps - round(config.decay_fraction * planned_steps))
