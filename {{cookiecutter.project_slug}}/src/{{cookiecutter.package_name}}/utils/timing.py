"""Time limits of a session: checkpoints every `checkpoint_every_minutes`, and a stop before `time_budget`.

Both are decided at logging steps only, on the main process's clock. The main process puts its decisions
into the reduce that logging does anyway (the other processes add zeros), so every process acts on the
same decision at the same step without a synchronisation of its own.

Why one clock rather than a vote of every process's: the processes advance in lockstep (each optimizer
step waits for every process's gradients), so their clocks would agree anyway; the main process also does
the work the others wait for at the end (metrics.jsonl, the exports), so its measurements are
the ones that cover a stopping run's tail; and the other processes never need to read a clock.
"""

from __future__ import annotations

import time

from .config import TrainConfig, parse_duration


class SessionClock:
    """The main process's view of the session's time, read once per logging interval."""

    def __init__(self, config: TrainConfig, main_process: bool) -> None:
        self.checkpoint_seconds = 60 * config.checkpoint_every_minutes
        self.budget, self.budget_text = parse_duration(config.time_budget) or 0.0, config.time_budget
        self.enabled = main_process and (self.checkpoint_seconds > 0 or self.budget > 0)
        self.start = self.last_log = self.last_checkpoint = time.monotonic()
        self.longest_interval = 0.0  # between logging steps, start-up included in the first
        self.longest_save = 0.0  # one checkpoint, measured by `saved`

    def at_log(self) -> tuple[float, float]:
        """(checkpoint now, stop now), 1.0 for yes, for the logging reduce; zeros on the other processes.

        Stop when one more logging interval, then a checkpoint and the export (which writes the weights
        again, so no longer than the checkpoint), would not fit in what is left of the budget: after
        this logging step the next chance to stop is one interval away.
        """
        if not self.enabled:
            return 0.0, 0.0
        now = time.monotonic()
        self.longest_interval = max(self.longest_interval, now - self.last_log)
        self.last_log = now
        checkpoint = 0 < self.checkpoint_seconds <= now - self.last_checkpoint
        stop = 0 < self.budget <= now - self.start + self.reserve()
        return float(checkpoint), float(stop)

    def reserve(self) -> float:
        """Seconds kept for one more logging interval, a checkpoint and the export."""
        return self.longest_interval + 2 * self.longest_save

    def saved(self, started: float, written: float = 0.0) -> None:
        """A checkpoint begun at `started` (time.monotonic()) is handed over: time the next one from now.
        `written`: the seconds its writing took, in the background (a stop waits for all of it)."""
        now = time.monotonic()
        self.longest_save = max(self.longest_save, now - started, written)
        self.last_checkpoint = now

    def stop_note(self) -> str:
        """Why the run stopped for time, for the main process's last line."""
        used, kept = format_duration(time.monotonic() - self.start), format_duration(self.reserve())
        return (
            f"{used} of time_budget {self.budget_text} used, {kept} of it kept for one more logging "
            "interval, a checkpoint and the export"
        )


def format_duration(seconds: float) -> str:
    """11h40m, 3m05s, 12s, 0.4s: as time_budget is written, to the second."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
