"""Time limits of a session: checkpoints so that a kill loses at most `max_time_lost`, a stop before
`time_budget` (docs/resume.md), a signal's within a second; decided on the main process's clock (processes
advance in lockstep) at votes, steps about VOTE_S apart and logging steps, and carried by the vote's reduce
(the other processes add zeros): every process acts at the same step without a sync of its own."""

from __future__ import annotations

import math
import time
from typing import Any

from ..config import TrainConfig, parse_duration

LOOP_SHARE = 0.02  # the most of the wall time that checkpoints may stop the loop for
VOTE_S = 0.5  # seconds between votes: a signal waits for one at most (a sync each, not one per step)


class SessionClock:
    """The main process's view of the session's time; `saver` and `mirror` time checkpoints' write, copy."""

    def __init__(self, config: TrainConfig, main_process: bool, saver: Any, mirror: Any) -> None:
        self.lost = parse_duration(config.max_time_lost) or 0.0
        self.lost_text = config.max_time_lost
        self.budget = parse_duration(config.time_budget) or 0.0
        self.budget_text = config.time_budget
        self.enabled = main_process
        self.saver = saver
        self.mirror = mirror
        self.steps = config.checkpoint_every
        self.start = self.last_log = time.monotonic()
        self.longest_interval = 0.0  # between logging steps, start-up included in the first
        self.longest_save = self.stop_s = 0.0  # a whole checkpoint; the loop's stop for the last one
        self.checkpoint_interval = 0.0  # steps between checkpoints, as the main process's vote agreed
        self.cost_line_printed = False
        self.vote_s = min(VOTE_S, self.lost / 10) if self.lost else VOTE_S  # also the plan's margin
        self.begin(0)

    def begin(self, step: int) -> None:
        """The loop starts at `step`: a kill from now on loses the time since then, until a checkpoint."""
        self.checkpoint_step = self.voted_step = self.next_vote = step
        self.voted_at = time.monotonic()
        self.step_s = 0.0  # the pace before the last vote
        self.checkpoints = [(step, self.voted_at)]  # (step, reached at) from the newest durable

    def vote(self, step: int, logging: bool) -> tuple[float, float, float]:
        """(checkpoint interval in steps, stop now: 1.0, steps to the next vote), for the reduce; zeros on the
        other processes. The budget is read at logging steps: stop when one more logging interval, a
        checkpoint and the export (no longer than a checkpoint) would not fit in what is left of it."""
        if not self.enabled:
            return 0.0, 0.0, 0.0
        now = time.monotonic()
        step_s = max(1e-9, now - self.voted_at) / max(1, step - self.voted_step)  # a slow start, forgotten
        steady_s = min(step_s, self.step_s)  # a step's own time: not one evaluation's or the compile's
        self.voted_step = step
        self.voted_at = now
        self.step_s = step_s
        late = 0.0
        if logging:
            self.longest_interval = max(self.longest_interval, now - self.last_log)
            self.last_log = now
            late = float(0 < self.budget <= now - self.start + self.reserve())
        return self.plan(step, now, step_s, steady_s), late, float(max(1, math.floor(self.vote_s / step_s)))

    def plan(self, step: int, now: float, step_s: float, steady_s: float) -> float:
        """Steps from the last checkpoint's to the next, at `step_s` a step: durable within max_time_lost of
        the last, less a vote interval (the pace may change before the next vote corrects the plan)."""
        if not self.lost:
            return 0.0
        since = now - self.checkpoints[-1][1]  # since the last checkpoint's step was reached
        longest, shortest = self.interval(steady_s)  # whole steps: within the first, never under the second
        ahead = max(math.floor((longest - since) / step_s), math.ceil((shortest - since) / step_s))
        return float(step - self.checkpoint_step + max(0, ahead))

    def interval(self, step_s: float = 0.0) -> tuple[float, float]:
        """Seconds from a checkpoint to the next: at most such that its stop, write and copy still fit in
        max_time_lost (half of it until one is measured); at least what checkpoints cost, and one step."""
        write = self.saver.last_seconds
        copy = self.mirror.copy_seconds
        longest = self.lost - self.vote_s - (self.stop_s + write + copy if self.stop_s else self.lost / 2)
        cost, why = max(
            (self.stop_s / LOOP_SHARE, f"each stops training for {format_duration(self.stop_s)}, 2% at most"),
            (write, f"each checkpoint's write takes {format_duration(write)}"),
            (copy, f"each copy to {self.mirror.target} takes {format_duration(copy)}"),
            (step_s, f"each step takes {format_duration(step_s)}"),
        )
        if cost > longest and not self.cost_line_printed:
            self.cost_line_printed = True
            risk = format_duration(self.lost - longest + cost)
            line = f"checkpoints every {format_duration(cost)}, not as max_time_lost {self.lost_text} needs"
            print(f"{line}: {why} (a kill may cost up to {risk})", flush=True)
        return longest, cost

    def at_risk(self) -> float | None:
        """Seconds of training a kill now loses: since the newest checkpoint durable where the next session
        looks (with a mirror_dir, the mirror's verified copy). None without max_time_lost."""
        if not self.lost:
            return None
        durable = self.mirror.newest_step if self.mirror.store is not None else self.saver.published_step
        while len(self.checkpoints) > 1 and self.checkpoints[1][0] <= durable:
            self.checkpoints.pop(0)
        return time.monotonic() - self.checkpoints[0][1]

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due at `step`, for max_time_lost or checkpoint_every (on every process)."""
        for_time = 0 < self.checkpoint_interval <= step - self.checkpoint_step
        return for_time or (self.steps > 0 and step % self.steps == 0)

    def reserve(self) -> float:
        """Seconds kept for one more logging interval, a checkpoint and the export."""
        return self.longest_interval + 2 * self.longest_save

    def saved(self, step: int, started: float, written: float = 0.0) -> None:
        """A checkpoint of `step` begun at `started` is handed over (every process); `written`: the seconds
        the last write took, in the background (a stop waits for all of it)."""
        self.stop_s = time.monotonic() - started
        self.longest_save = max(self.longest_save, self.stop_s, written)
        self.checkpoint_step = step
        self.checkpoints.append((step, started))

    def stop_note(self) -> str:
        """Why the run stopped for time, for the main process's last line."""
        used = format_duration(time.monotonic() - self.start)
        kept = format_duration(self.reserve())
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
