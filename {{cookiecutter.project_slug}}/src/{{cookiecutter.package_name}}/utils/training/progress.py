"""Training progress, on the main process: a live tqdm bar where a person watches (PROGRESS_BAR=1),
else a plain line now and then, since in a file (a SLURM .out, CI) every redraw would land as a frame."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from .timing import format_duration

# The first line once the speed means something, then one every so often (a 12-hour job: about 1,400).
FIRST_LINE_AFTER_S = 5.0
LINE_EVERY_S = 30.0


class Progress:
    """Counts optimizer steps and shows them; `write` prints an event line (above a live bar)."""

    def __init__(self, total: int, initial: int, enabled: bool, at_risk: Callable = lambda: None) -> None:
        self.total = total
        self.step = initial
        self.start_step = initial
        self.enabled = enabled
        self.at_risk = at_risk
        self.loss = None  # set by loop.py: the last logging interval's mean
        self.epoch: float | None = None  # set by loop.py: the epochs done, fractional
        self.metric = ""  # set by loop.py: the last evaluation's best_metric, e.g. `eval/accuracy 0.9777`
        self.started = time.monotonic()
        self.next_line = self.started + FIRST_LINE_AFTER_S
        self.bar = None
        if enabled and (sys.stdout.isatty() or os.environ.get("PROGRESS_BAR") == "1"):
            from tqdm import tqdm  # only where a bar is drawn

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stdout)

    def update(self) -> None:
        """One optimizer step done: called at every step, so it does as little as it can."""
        self.step += 1
        if self.bar is not None:
            self.bar.set_postfix_str(" | ".join(self.parts()), refresh=False)
            self.bar.update()
        elif self.enabled and (self.step == self.total or time.monotonic() >= self.next_line):
            self.write(self.line())
            self.next_line = time.monotonic() + LINE_EVERY_S

    def write(self, line: str) -> None:
        """An event (a checkpoint, a stop): one line, from the main process only."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        elif self.enabled:
            print(line, flush=True)

    def parts(self) -> list[str]:
        """Beside step, speed and time left: epoch, loss, the last evaluation, what a kill would cost now."""
        parts = [f"epoch {self.epoch:.2f}"] if self.epoch is not None else []
        parts += [f"loss {self.loss:.4f}"] if self.loss is not None else []
        parts += [self.metric] if self.metric else []
        if (risk := self.at_risk()) is not None:
            parts.append(f"at risk {format_duration(risk)}")
        return parts

    def line(self) -> str:
        """step, loss, speed and time left, e.g. `step 120/440 (27%) | loss 0.4312 | 35.2 steps/s | ...`."""
        elapsed = time.monotonic() - self.started
        done = self.step - self.start_step
        parts = [f"step {self.step}/{self.total} ({100 * self.step // max(1, self.total)}%)", *self.parts()]
        if done and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{rate:.1f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
            parts.append(f"elapsed {format_duration(elapsed)}")
            parts.append(f"ETA {format_duration((self.total - self.step) / rate)}")
        return "train: " + " | ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.step < self.total:  # it ended early: where, before the end lines
            self.write(self.line())
