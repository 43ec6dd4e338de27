"""Training progress as a plain line now and then, which reads the same on a terminal and in a log (a
file, a SLURM .out, a Kaggle commit log, CI, `!python` in a notebook), where every redraw of a live bar
would land as another carriage-return frame. Only the main process shows progress; the others keep quiet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .timing import format_duration

# The first line once the speed means something, then one line every so often. A
# 12-hour SLURM job logs about 1,400 lines this way; a 10-second laptop run one or two.
FIRST_LINE_AFTER_S = 5.0
LINE_EVERY_S = 30.0


class Progress:
    """Counts optimizer steps and shows them; `write` prints an event line."""

    def __init__(self, total: int, initial: int, enabled: bool, at_risk: Callable = lambda: None) -> None:
        self.total, self.step, self.enabled, self.at_risk = total, initial, enabled, at_risk
        self.start_step, self.loss = initial, None  # loss: the last logging interval's mean (set by loop.py)
        self.started = self.last_line = time.monotonic()
        self.next_line = self.started + FIRST_LINE_AFTER_S

    def update(self) -> None:
        """One optimizer step done: called at every step, so it does as little as it can."""
        self.step += 1
        if self.enabled and (self.step == self.total or time.monotonic() >= self.next_line):
            self.write(self.line())
            self.next_line = time.monotonic() + LINE_EVERY_S

    def write(self, line: str) -> None:
        """An event (a checkpoint, a stop): one line, from the main process only."""
        if self.enabled:
            print(line, flush=True)

    def line(self) -> str:
        """step, loss, speed and time left, e.g. `step 120/440 (27%) | loss 0.4312 | 35.2 steps/s | ...`."""
        elapsed = time.monotonic() - self.started
        done = self.step - self.start_step
        parts = [f"step {self.step}/{self.total} ({100 * self.step // max(1, self.total)}%)"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if done and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{rate:.1f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
            parts.append(f"elapsed {format_duration(elapsed)}")
            parts.append(f"ETA {format_duration((self.total - self.step) / rate)}")
        if (risk := self.at_risk()) is not None:  # what a kill now would cost (max_time_lost)
            parts.append(f"at risk {format_duration(risk)}")
        return "train: " + " | ".join(parts)
