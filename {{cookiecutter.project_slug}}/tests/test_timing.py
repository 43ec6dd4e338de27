"""Time limits (utils/timing.py), on a clock the test moves by hand: what is decided at each logging step.

train.py and a real run are tested in test_guarantees.py; here only the arithmetic, with no wall clock.
"""

from __future__ import annotations

import time

import pytest

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import parse_duration
from {{ cookiecutter.package_name }}.utils.timing import SessionClock, format_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("11h40m", 42000), ("90m", 5400), ("45s", 45), ("1.5h", 5400), ("1h0m30s", 3630), ("", 0), ("0s", 0)],
)
def test_durations_are_read_in_hours_minutes_and_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["11:40", "40m11h", "5", "1d", "-5m", "m", "1 h"])
def test_other_texts_are_not_durations(text: str) -> None:
    assert parse_duration(text) is None


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """time.monotonic, moved by the test: now[0] += seconds."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return clock


def test_the_run_stops_when_one_more_interval_a_checkpoint_and_the_export_would_not_fit(
    now: list[float],
) -> None:
    clock = SessionClock(task.Config(time_budget="10m"), main_process=True)
    start = now[0]
    for seconds in (60, 150, 230, 310, 390, 449):  # logging steps; the longest interval: 90 s
        if seconds == 150:
            now[0] = start + 90
            clock.saved(start + 60)  # a checkpoint of 30 s
        now[0] = start + seconds
        assert clock.at_log() == (0.0, 0.0), seconds
    # A stop needs 90 s (an interval) + 2 x 30 s (a checkpoint, the export) = 150 s of the 600.
    now[0] = start + 450
    assert clock.at_log() == (0.0, 1.0)
    assert clock.stop_note().startswith("7m30s of time_budget 10m used, 2m30s of it kept")


def test_a_checkpoint_is_due_at_the_first_logging_step_after_the_interval(now: list[float]) -> None:
    clock = SessionClock(task.Config(checkpoint_every_minutes=2), main_process=True)
    start = now[0]
    decisions = []
    for seconds in (60, 119, 120, 180, 244, 245):  # logging steps
        if seconds == 180:
            now[0] = start + 125
            clock.saved(start + 120)  # the next is due 2 minutes after this one ended
        now[0] = start + seconds
        decisions.append(clock.at_log()[0])
    assert decisions == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_only_the_main_process_reads_its_clock(now: list[float]) -> None:
    config = task.Config(time_budget="1s", checkpoint_every_minutes=0.01)
    other = SessionClock(config, main_process=False)
    off = SessionClock(task.Config(), main_process=True)  # no budget, no time-based checkpoints
    now[0] += 3600
    assert other.at_log() == off.at_log() == (0.0, 0.0)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.42, "0.4s"), (12.4, "12s"), (185, "3m05s"), (42000, "11h40m"), (3599.6, "1h00m")]
)
def test_durations_are_printed_as_time_budget_is_written(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
