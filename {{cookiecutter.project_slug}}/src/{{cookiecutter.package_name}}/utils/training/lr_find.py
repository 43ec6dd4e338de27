"""`--find_lr true`: a learning-rate range test through the loop's own setup (docs/configuration.md)."""

from __future__ import annotations

import math
from itertools import chain, count
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ..checkpoints.checkpoint import LoopState
from ..config import TrainConfig
from .loop import epoch_batches
from .resume_check import StepDigest
from .streams import StreamLoader

LOW = 1e-7  # the sweep: fastai's bounds and length
HIGH = 10.0
STEPS = 100
BETA = 0.98  # the loss's moving average
DIVERGED = 4.0  # stop once the smoothed loss exceeds this multiple of its best
SKIP = 10  # the first points (an average of few losses) never hold the suggestion


def find_lr(accelerator: Accelerator, config: TrainConfig, optimizer: Any, loader: Any, *step: Any) -> bool:
    """An optimizer step per rate from LOW to HIGH, through train.py's `step_gradients` (`step`: it, the
    model, its forward), the loss averaged over processes (one curve on all); the suggestion, lr_find.png."""
    step_gradients, model, forward = step
    trained = [param for param in model.parameters() if param.requires_grad]
    state = LoopState()  # what step_gradients and epoch_batches read: the step (dropout's seeds), the epoch
    book = SimpleNamespace(state=state, loss=SimpleNamespace(sum=torch.zeros((), dtype=torch.float64)))
    gradients = step_gradients(accelerator, config, model, forward, trained, book)
    rates = [LOW * (HIGH / LOW) ** (i / (STEPS - 1)) for i in range(STEPS)]
    smoothed: list[float] = []
    average = 0.0
    streamed = isinstance(loader, StreamLoader)
    train_set = loader.stream if streamed else loader.dataset  # what tells epoch_batches a stream
    epochs = (epoch_batches(loader, train_set, state, accelerator, config) for state.epoch in count())
    for batch in chain.from_iterable(epochs):  # epochs on end
        for group in optimizer.param_groups:
            group["lr"] = rates[state.step]
        step_loss = gradients(batch, StepDigest(accelerator, active=False))
        optimizer.step()
        optimizer.zero_grad()
        loss = accelerator.reduce(step_loss, "mean").item() / accelerator.gradient_accumulation_steps
        average = BETA * average + (1 - BETA) * loss
        state.step += 1
        smoothed.append(average / (1 - BETA**state.step))  # bias-corrected
        if not math.isfinite(loss) or smoothed[-1] > DIVERGED * min(smoothed) or state.step == STEPS:
            break
    if streamed:  # its loader's workers end
        loader.close()
    if accelerator.is_main_process:
        report(f"{config.output_dir}/lr_find.png", rates[: len(smoothed)], smoothed)
    return True


def report(path: str, rates: list[float], smoothed: list[float]) -> None:
    """Draw the curve to `path`; print one line with the suggestion: where the smoothed loss falls fastest
    against log10 of the rate (the steepest descent, as Lightning's finder suggests)."""
    from matplotlib.figure import Figure  # here only (a second to import); Agg, without pyplot or a window

    axes = (figure := Figure(figsize=(5, 3.5), layout="tight")).subplots()
    axes.plot(rates, smoothed, label="smoothed loss")
    axes.set(xscale="log", xlabel="learning rate", ylabel="train loss", title="learning-rate range test")
    line = f"lr_find: the loss diverged after {len(rates)} steps: no rate to suggest; curve: {path}"
    points = len(smoothed) - (not math.isfinite(smoothed[-1]))  # those before a loss that overflowed
    if points > SKIP + 2:
        best = SKIP + int(np.argmin(np.gradient(smoothed[:points], np.log10(rates[:points]))[SKIP:-1]))
        rate = f"{rates[best]:.2e}"
        axes.plot(rates[best], smoothed[best], "o", label=f"suggested {rate}")
        line = f"lr_find: suggested learning rate {rate}: train with --learning_rate {rate}; curve: {path}"
    axes.legend()
    figure.savefig(path, format="png", dpi=80)
    print(line, flush=True)
