"""`--find_lr true`: a learning-rate range test on the task's own model and data, through the loop's setup
(docs/configuration.md). Writes lr_find.png only: no checkpoint, history, tracker run or metrics."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import IterableDataset

from .checkpoint import LoopState
from .config import TrainConfig
from .durable import write_atomically
from .exact import StepDigest
from .loop import epoch_batches

LOW, HIGH, STEPS = 1e-7, 10.0, 100  # the sweep: fastai's bounds and length
BETA = 0.98  # the loss's moving average
DIVERGED = 4.0  # stop once the smoothed loss exceeds this multiple of its best
SKIP = 10  # the first points, where the average has seen few losses, never hold the suggestion


def find_lr(
    accelerator: Accelerator,
    config: TrainConfig,
    model: torch.nn.Module,
    forward: torch.nn.Module,
    trained: list[torch.nn.Parameter],
    optimizer: Any,
    loader: Any,
    train_set: Any,
    step_gradients: Callable,
) -> bool:
    """Sweep the learning rate exponentially from LOW to HIGH, one optimizer step of train.py's
    `step_gradients` each (the loss averaged over processes: every process sees the same curve); then
    print the suggestion and draw lr_find.png (the main process)."""
    state = LoopState()  # what step_gradients and epoch_batches read: the step (dropout's seeds), the epoch
    book = SimpleNamespace(state=state, loss=SimpleNamespace(sum=torch.zeros((), dtype=torch.float64)))
    gradients = step_gradients(accelerator, config, model, forward, trained, book)
    streamed = isinstance(train_set, IterableDataset)
    rates: list[float] = []
    smoothed: list[float] = []
    average = 0.0
    done = False
    model.train()
    try:
        while not done:
            for batch in epoch_batches(loader, train_set, state, accelerator, config):
                rates.append(LOW * (HIGH / LOW) ** (state.step / (STEPS - 1)))
                for group in optimizer.param_groups:
                    group["lr"] = rates[-1]
                step_loss = gradients(batch, StepDigest(accelerator, active=False))
                optimizer.step()
                optimizer.zero_grad()
                loss = accelerator.reduce(step_loss, "mean").item() / accelerator.gradient_accumulation_steps
                average = BETA * average + (1 - BETA) * loss
                state.step += 1
                smoothed.append(average / (1 - BETA**state.step))  # bias-corrected
                diverged = not math.isfinite(loss) or smoothed[-1] > DIVERGED * min(smoothed)
                done = diverged or state.step == STEPS
                if done:
                    break
            else:
                state.epoch += not streamed  # the set ran out: the next epoch (a stream counts its own)
    finally:
        if streamed:  # its loader's workers end
            loader.close()
    if accelerator.is_main_process:
        report(Path(config.output_dir) / "lr_find.png", rates, smoothed)
    return True


def report(path: Path, rates: list[float], smoothed: list[float]) -> None:
    """Draw the curve to `path`; print one line with the suggestion: the steepest descent of the smoothed
    loss against log10 of the rate, as Lightning's finder makes it."""
    finite = [i for i, loss in enumerate(smoothed) if math.isfinite(loss)]
    from matplotlib.figure import Figure  # here only (a second to import); Agg, without pyplot or a window

    figure = Figure(figsize=(5, 3.5), layout="tight")
    axes = figure.subplots()
    axes.plot(rates, smoothed, label="smoothed loss")
    axes.set(xscale="log", xlabel="learning rate", ylabel="train loss", title="learning-rate range test")
    line = f"lr_find: the loss diverged after {len(rates)} steps: no rate to suggest; curve: {path}"
    if len(finite) > SKIP + 2:
        slopes = np.gradient(np.array(smoothed)[finite], np.log10(np.array(rates)[finite]))
        best = finite[SKIP + int(np.argmin(slopes[SKIP:-1]))]
        axes.plot(rates[best], smoothed[best], "o", label=f"suggested {rates[best]:.2e}")
        rate = f"{rates[best]:.2e}"
        line = f"lr_find: suggested learning rate {rate}: train with --learning_rate {rate}; curve: {path}"
    axes.legend()
    figure.savefig(png := io.BytesIO(), format="png", dpi=80)
    write_atomically(path, png.getvalue(), durable=False)
    print(line, flush=True)
