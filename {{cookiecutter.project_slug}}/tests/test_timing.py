"""Time limits (training/timing.py): on a clock the test moves by hand, what is decided at each vote; then
real runs (a slow first step, a load that comes and goes, SIGKILLs, stop signals) against max_time_lost, the
checkpoints' 2% share of the time, and a stop within a second."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.config import parse_duration
from {{ cookiecutter.package_name }}.utils.training.timing import SessionClock, format_duration


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
        assert clock.vote(step + 1, logging=True)[:2] == (0.0, 0.0), seconds
    # A stop needs 90 s (an interval) + 2 x 30 s (a checkpoint, the export) = 150 s of the 600.
    now[0] = start + 450
    assert clock.vote(7, logging=True)[:2] == (0.0, 1.0)
    assert clock.stop_note().startswith("7m30s of time_budget 10m used, 2m30s of it kept")


def test_checkpoints_come_so_that_each_is_durable_within_max_time_lost_of_the_last(now: list[float]) -> None:
    """The interval in steps, counted from the last checkpoint's step, at the pace since the last vote: until
    a checkpoint is measured, half of max_time_lost is kept for its cost; then its stop, write and copy are;
    a vote interval (0.5 s) is kept too, for a pace that changes before the next vote."""
    clock = clock_of(task.Config(max_time_lost="1m"))
    clock.begin(100)  # resumed at step 100
    now[0] += 2.0  # a slow first step: 2 s
    assert clock.vote(101, logging=False) == (1 + 13, 0.0, 1.0)  # 29.5 s at 2 s a step: steps 101 to 114
    now[0] = 1006.5  # step 110: 0.5 s a step since step 101
    interval, _, ahead = clock.vote(110, logging=True)
    clock.checkpoint_interval = int(interval)  # as the vote's reduce hands it to every process
    assert (clock.checkpoint_interval, ahead) == (10 + 46, 1.0)  # 23 s left of the 29.5, at 0.5 s a step
    assert not clock.due(155) and clock.due(156)
    now[0] = 1029.75
    clock.saved(156, started=1029.5)  # measured: it stopped the loop for 0.25 s
    clock.saver.last_seconds = 0.75  # and its write, in the background, took 0.75 s
    now[0] = 1039.5  # step 176: 0.5 s a step since step 110
    # Due 60 - 0.5 - 0.25 - 0.75 = 58.5 s after step 156 was reached, 48.5 s from now: 97 steps more.
    assert clock.vote(176, logging=True) == (20 + 97, 0.0, 1.0)


def test_the_cost_bound_rounds_up_to_whole_steps_and_the_time_bound_down(now: list[float]) -> None:
    """Slow steps: checkpoints never closer than their cost allows, nor further apart than max_time_lost."""
    clock = clock_of(task.Config(max_time_lost="10s"))
    clock.begin(0)
    now[0] += 1.0
    clock.vote(1, logging=False)
    clock.saved(1, started=now[0] - 0.1)  # a loop stop of 0.1 s
    clock.saver.last_seconds = 6.0  # and a write of 6 s: 6 s apart at least
    now[0] += 4.5  # step 4: 1.5 s a step since step 1
    assert clock.vote(4, logging=True)[0] == 3 + 1  # 1.4 s to go: one step more, not none
    clock.saver.last_seconds, clock.stop_s = 0.0, 0.01  # the time bound: 9.49 s, 4.89 s to go
    assert clock.plan(4, now[0], 1.5, 1.5) == 3 + 3  # 3 whole steps, not 4


def test_a_slow_first_step_is_followed_by_one_checkpoint_then_the_pace_of_the_steps(now: list[float]) -> None:
    """A first step over half of max_time_lost (compiling) is checkpointed at once; the next vote, one step
    later, plans from the fast steps alone: not a checkpoint at every step until the next logging step."""
    clock = clock_of(task.Config(max_time_lost="1m"))
    clock.begin(0)
    now[0] += 45.0
    assert clock.vote(1, logging=False) == (1.0, 0.0, 1.0)
    now[0] += 0.25
    clock.saved(1, started=now[0] - 0.25)
    now[0] += 0.25  # step 2: 0.5 s since the vote, the checkpoint's stop included
    # Due 60 - 0.5 - 0.25 = 59.25 s after step 1 was reached, 58.75 s from now: 117 steps more.
    assert clock.vote(2, logging=False) == (1 + 117, 0.0, 1.0)


def test_votes_come_about_half_a_second_apart_at_the_pace_since_the_last(now: list[float]) -> None:
    clock = clock_of(task.Config(max_time_lost=""))
    clock.begin(0)
    now[0] += 0.01
    assert clock.vote(1, logging=False) == (0.0, 0.0, 50.0)  # 0.01 s a step: step 51 votes next
    now[0] += 49 * 0.04  # a load came: 0.04 s a step
    assert clock.vote(50, logging=False)[2] == 12.0
    now[0] += 30  # an evaluation, or steps longer than the interval: the next step votes
    assert clock.vote(62, logging=False)[2] == 1.0
    assert clock_of(task.Config(max_time_lost="1s")).vote_s == 0.1  # a tenth of a short max_time_lost


def test_where_checkpoints_cost_more_than_max_time_lost_allows_one_line_says_what_the_run_holds(
    now: list[float], capsys: pytest.CaptureFixture[str]
) -> None:
    clock = clock_of(task.Config(max_time_lost="1m"), mirror_dir="/content/drive/run")
    clock.begin(0)
    now[0] += 1.0
    clock.saved(1, started=now[0] - 0.5)  # stops the loop for 0.5 s
    assert clock.interval() == (59.0, 25.0)  # due 59 s after the last (a vote kept), durable 0.5 s later; 2%
    clock.mirror.copy_seconds = 110.0  # a slow Drive
    assert clock.interval() == (60 - 0.5 - 0.5 - 110.0, 110.0)
    assert clock.interval()[1] == 110.0
    assert capsys.readouterr().out == (
        "checkpoints every 1m50s, not as max_time_lost 1m needs: each copy to /content/drive/run takes 1m50s "
        "(a kill may cost up to 3m41s)\n"  # the once
    )
    clock.mirror.copy_seconds, clock.stop_s = 0.0, 2.0
    assert clock.interval() == (57.5, 100.0)  # loop stops: 2% of the time at most
    slow = clock_of(task.Config(max_time_lost="1m"))
    assert slow.interval(step_s=100.0) == (29.5, 100.0)  # a step's own time, longer than the bound
    assert capsys.readouterr().out == (
        "checkpoints every 1m40s, not as max_time_lost 1m needs: each step takes 1m40s "
        "(a kill may cost up to 2m10s)\n"
    )


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
    assert other.vote(5, logging=True) == (0.0, 0.0, 0.0)
    assert off.vote(5, logging=True)[:2] == (0.0, 0.0)
    assert [step for step in range(1, 20) if other.due(step)] == [7, 14]
    other.checkpoint_interval = 5  # the main process's vote, through the vote's reduce
    other.saved(3, now[0])
    assert [step for step in range(4, 20) if other.due(step)] == [7, *range(8, 20)]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.42, "0.4s"), (12.4, "12s"), (185, "3m05s"), (42000, "11h40m"), (3599.6, "1h00m")]
)
def test_durations_are_printed_as_time_budget_is_written(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
