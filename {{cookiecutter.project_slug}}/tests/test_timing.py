"""Time limits (utils/timing.py), on a clock the test moves by hand: what is decided at each logging step.

train.py and a real run are tested in test_guarantees.py; here only the arithmetic, with no wall clock.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

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


def clock_of(config: task.Config, main_process: bool = True, mirror_dir: str = "") -> SessionClock:
    """A SessionClock with stand-ins for the Persister and the Mirror it reads its costs from."""
    saver = SimpleNamespace(last_seconds=0.0, published_step=-1)
    mirror = SimpleNamespace(copy_seconds=0.0, newest_step=-1, store=mirror_dir or None, target=mirror_dir)
    return SessionClock(config, main_process, saver, mirror)


def test_the_run_stops_when_one_more_interval_a_checkpoint_and_the_export_would_not_fit(
    now: list[float],
) -> None:
    clock = clock_of(task.Config(time_budget="10m", max_time_lost=""))
    start = now[0]
    # Logging steps; the longest interval: 90 s
    for step, seconds in enumerate((60, 150, 230, 310, 390, 449)):
        if seconds == 150:
            now[0] = start + 90
            clock.saved(step, start + 60)  # a checkpoint of 30 s
        now[0] = start + seconds
        assert clock.at_log(step + 1) == (0.0, 0.0), seconds
    # A stop needs 90 s (an interval) + 2 x 30 s (a checkpoint, the export) = 150 s of the 600.
    now[0] = start + 450
    assert clock.at_log(7) == (0.0, 1.0)
    assert clock.stop_note().startswith("7m30s of time_budget 10m used, 2m30s of it kept")


def test_checkpoints_come_so_that_each_is_durable_within_max_time_lost_of_the_last(now: list[float]) -> None:
    """The interval in steps, counted from the last checkpoint's step: until a checkpoint is measured, half
    of max_time_lost is kept for its cost; then its stop, write and copy are."""
    clock = clock_of(task.Config(max_time_lost="1m"))
    clock.begin(100)  # resumed at step 100
    now[0] += 2.0  # a slow first step: 2 s
    assert clock.at_log(101, logging=False) == (1 + 14, 0.0)  # 30 s at 2 s a step: steps 101 to 115
    now[0] = 1005.5  # step 110: 0.55 s a step since step 100
    clock.every = int(clock.at_log(110)[0])  # as the logging reduce hands it to every process
    assert clock.every == 10 + 44  # 24.5 s left of the 30, at 0.55 s a step: 44.5
    assert not clock.due(153) and clock.due(154)
    now[0] = 1030.0
    clock.saved(154, started=1029.75)  # measured: it stopped the loop for 0.25 s
    clock.saver.last_seconds = 0.75  # and its write, in the background, took 0.75 s
    now[0] = 1039.75  # step 174: 0.5 s a step since step 154
    # Due 60 - 0.25 - 0.75 = 59 s after step 154 was reached, 49 s from now: 98 steps more.
    assert clock.at_log(174) == (20 + 98, 0.0)


def test_the_cost_bound_rounds_up_to_whole_steps_and_the_time_bound_down(now: list[float]) -> None:
    """Slow steps: checkpoints never closer than their cost allows, nor further apart than max_time_lost."""
    clock = clock_of(task.Config(max_time_lost="10s"))
    clock.begin(0)
    now[0] += 1.0
    clock.saved(1, started=now[0] - 0.1)  # a loop stop of 0.1 s
    clock.saver.last_seconds = 6.0  # and a write of 6 s: 6 s apart at least
    now[0] += 4.4  # step 4: 1.5 s a step since step 1, 4.5 s since it
    assert clock.at_log(4) == (3 + 1, 0.0)  # 1.5 s to go: one step more, not none
    clock.saver.last_seconds, clock.stop_s = 0.0, 0.01  # the time bound: 9.99 s, 5.49 s to go
    assert clock.at_log(4) == (3 + 3, 0.0)  # 3 whole steps, not 4


def test_a_slow_first_step_is_followed_by_a_checkpoint_at_once(now: list[float]) -> None:
    clock = clock_of(task.Config(max_time_lost="1m"))
    clock.begin(0)
    now[0] += 45.0  # compiling: over half of max_time_lost
    assert clock.at_log(1, logging=False) == (1.0, 0.0)


def test_where_checkpoints_cost_more_than_max_time_lost_allows_one_line_says_what_the_run_holds(
    now: list[float], capsys: pytest.CaptureFixture[str]
) -> None:
    clock = clock_of(task.Config(max_time_lost="1m"), mirror_dir="/content/drive/run")
    clock.begin(0)
    now[0] += 1.0
    clock.saved(1, started=now[0] - 0.5)  # stops the loop for 0.5 s
    assert clock.interval() == (59.5, 25.0)  # due 59.5 s after the last, durable 0.5 s later; 2%: 25 s
    clock.mirror.copy_seconds = 110.0  # a slow Drive
    assert clock.interval() == (60 - 0.5 - 110.0, 110.0)
    assert clock.interval()[1] == 110.0
    assert capsys.readouterr().out == (
        "checkpoints every 1m50s, not as max_time_lost 1m needs: each copy to /content/drive/run takes 1m50s "
        "(a kill may cost up to 3m40s)\n"  # the once
    )
    clock.mirror.copy_seconds, clock.stop_s = 0.0, 2.0
    assert clock.interval() == (58.0, 100.0)  # loop stops: 2% of the time at most


def test_at_risk_is_the_time_since_the_newest_checkpoint_durable_where_the_next_session_looks(
    now: list[float],
) -> None:
    local, mirrored = clock_of(task.Config()), clock_of(task.Config(), mirror_dir="/drive")
    start = now[0]
    for clock in (local, mirrored):
        clock.begin(0)
        clock.saved(10, started=start + 20)
        clock.saved(20, started=start + 40)
    now[0] = start + 50
    assert local.at_risk() == mirrored.at_risk() == 50  # neither is published yet
    local.saver.published_step = mirrored.saver.published_step = 20
    mirrored.mirror.newest_step = 10
    assert (local.at_risk(), mirrored.at_risk()) == (10, 30)
    assert clock_of(task.Config(max_time_lost="")).at_risk() is None


def test_only_the_main_process_reads_its_clock_and_every_process_counts_the_steps(now: list[float]) -> None:
    config = task.Config(time_budget="1s", max_time_lost="1s", checkpoint_every=7)
    other = clock_of(config, main_process=False)
    off = clock_of(task.Config(max_time_lost=""))  # no budget, no time-based checkpoints
    now[0] += 3600
    assert other.at_log(5) == off.at_log(5) == (0.0, 0.0)
    assert [step for step in range(1, 20) if other.due(step)] == [7, 14]
    other.every = 5  # the main process's vote, through the logging reduce
    other.saved(3, now[0])
    assert [step for step in range(4, 20) if other.due(step)] == [7, *range(8, 20)]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.42, "0.4s"), (12.4, "12s"), (185, "3m05s"), (42000, "11h40m"), (3599.6, "1h00m")]
)
def test_durations_are_printed_as_time_budget_is_written(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
