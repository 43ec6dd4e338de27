"""Time limits of a session: checkpoints so that a kill loses at most `max_time_lost`, a stop before
`time_budget` (docs/resume.md), a signal's within a second; decided on the main process's clock (processes
advance in lockstep) at votes, steps about VOTE_S apart and logging steps, and carried by the vote's reduce
(the other processes add zeros): every process acts at the same step without a sync of its own."""

from __future__ import annotations

import math
import time
from typing import Any

from .config import TrainConfig, parse_duration

LOOP_SHARE = 0.02  # the most of the wall time that checkpoints may stop the loop for
VOTE_S = 0.5  # seconds between votes: a signal waits for one at most (a sync each, not one per step)


class SessionClock:
    """The main process's view of the session's time; `saver` and `mirror` time checkpoints' write, copy."""

    def __init__(self, config: TrainConfig, main_process: bool, saver: Any, mirror: Any) -> None:
        self.lost, self.lost_text = parse_duration(config.max_time_lost) or 0.0, config.max_time_lost
        self.budget, self.budget_text = parse_duration(config.time_budget) or 0.0, config.time_budget
        self.enabled, self.saver, self.mirror = main_process, saver, mirror
        self.steps = config.checkpoint_every
        self.start = self.last_log = time.monotonic()
        self.longest_interval = 0.0  # between logging steps, start-up included in the first
        self.longest_save = self.stop_s = 0.0  # a whole checkpoint; the loop's stop for the last one
        self.every, self.said = 0.0, False  # the steps between checkpoints agreed on; the cost line printed
        self.vote_s = min(VOTE_S, self.lost / 10) if self.lost else VOTE_S  # also the plan's margin
        self.begin(0)

    def begin(self, step: int) -> None:
        """The loop starts at `step`: a kill from now on loses the time since then, until a checkpoint."""
        self.checkpoint_step = self.voted_step = self.next_vote = step
        self.voted_at, self.step_s = time.monotonic(), 0.0  # the last vote; the pace before it
        self.taken = [(step, self.voted_at)]  # (step, reached at) of checkpoints, from the newest durable

    def vote(self, step: int, logging: bool) -> tuple[float, float, float]:
        """(checkpoint interval in steps, stop now: 1.0, steps to the next vote), for the reduce; zeros on the
        other processes. The budget is read at logging steps: stop when one more logging interval, a
        checkpoint and the export (no longer than a checkpoint) would not fit in what is left of it."""
        if not self.enabled:
            return 0.0, 0.0, 0.0
        now = time.monotonic()
        step_s = max(1e-9, now - self.voted_at) / max(1, step - self.voted_step)  # a slow start, forgotten
        steady_s = min(step_s, self.step_s)  # a step's own time: not one evaluation's or the compile's
        self.voted_step, self.voted_at, self.step_s = step, now, step_s
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
        reached = self.taken[-1][1]  # when the last checkpoint's step was
        fits, cost = self.interval(steady_s)  # whole steps: within the first, never under the second
        ahead = max(math.floor((reached + fits - now) / step_s), math.ceil((reached + cost - now) / step_s))
        return float(step - self.checkpoint_step + max(0, ahead))

    def interval(self, step_s: float = 0.0) -> tuple[float, float]:
        """Seconds from a checkpoint to the next: at most such that its stop, write and copy still fit in
        max_time_lost (half of it until one is measured); at least what checkpoints cost, and one step."""
        write, copy = self.saver.last_seconds, self.mirror.copy_seconds
        fits = self.lost - self.vote_s - (self.stop_s + write + copy if self.stop_s else self.lost / 2)
        cost, why = max(
            (self.stop_s / LOOP_SHARE, f"each stops training for {format_duration(self.stop_s)}, 2% at most"),
            (write, f"each checkpoint's write takes {format_duration(write)}"),
            (copy, f"each copy to {self.mirror.target} takes {format_duration(copy)}"),
            (step_s, f"each step takes {format_duration(step_s)}"),
        )
        if cost > fits and not self.said:
            self.said, risk = True, format_duration(self.lost - fits + cost)
            line = f"checkpoints every {format_duration(cost)}, not as max_time_lost {self.lost_text} needs"
            print(f"{line}: {why} (a kill may cost up to {risk})", flush=True)
        return fits, cost

    def at_risk(self) -> float | None:
        """Seconds of training a kill now loses: since the newest checkpoint durable where the next session
        looks (with a mirror_dir, the mirror's verified copy). None without max_time_lost."""
        if not self.lost:
            return None
        durable = self.mirror.newest_step if self.mirror.store is not None else self.saver.published_step
        while len(self.taken) > 1 and self.taken[1][0] <= durable:
            self.taken.pop(0)
        return time.monotonic() - self.taken[0][1]

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due at `step`, for max_time_lost or checkpoint_every (on every process)."""
        return 0 < self.every <= step - self.checkpoint_step or (self.steps > 0 and step % self.steps == 0)

    def reserve(self) -> float:
        """Seconds kept for one more logging interval, a checkpoint and the export."""
        return self.longest_interval + 2 * self.longest_save

    def saved(self, step: int, started: float, written: float = 0.0) -> None:
        """A checkpoint of `step` begun at `started` is handed over (every process); `written`: the seconds
        the last write took, in the background (a stop waits for all of it)."""
        self.stop_s = time.monotonic() - started
        self.longest_save = max(self.longest_save, self.stop_s, written)
        self.checkpoint_step = step
        self.taken.append((step, started))

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
