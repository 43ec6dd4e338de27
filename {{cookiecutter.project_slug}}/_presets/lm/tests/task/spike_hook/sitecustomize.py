"""Put on PYTHONPATH by test_task.py: the optimizer steps $SPIKE_CALLS ("first-last", counted in this
process from its start, not by the step counter) take a learning rate $SPIKE_LR_FACTOR times too high: a
transient that a rollback to a checkpoint before it leaves behind."""

import os

import torch

_step = torch.optim.AdamW.step
calls = 0


def step(self, *args, **kwargs):
    global calls
    calls += 1
    first, last = (int(call) for call in os.environ["SPIKE_CALLS"].split("-"))
    factor = float(os.environ["SPIKE_LR_FACTOR"]) if first <= calls <= last else 1.0
    for group in self.param_groups:
        group["lr"] *= factor
    try:
        return _step(self, *args, **kwargs)
    finally:
        for group in self.param_groups:
            group["lr"] /= factor


torch.optim.AdamW.step = step
