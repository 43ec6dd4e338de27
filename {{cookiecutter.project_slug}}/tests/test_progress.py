"""Progress output: plain lines at intervals, from the main process only."""

from __future__ import annotations

import re

import pytest

from {{ cookiecutter.package_name }}.utils import progress as progress_module
from {{ cookiecutter.package_name }}.utils.progress import Progress


class Clock:
    """time.monotonic under the test's control: the interval logic is about seconds, not speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock_ = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock_)
    return clock_


def test_off_a_terminal_plain_lines_come_at_intervals_with_step_loss_speed_and_eta(
    fake_time: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(total=400, initial=100, enabled=True)  # resumed at step 100
    for _ in range(10):  # 10 steps in 2 s: too early for a line
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out == ""
    progress.loss = 0.4321
    for _ in range(20):  # 5 s after the start: the first line
        fake_time.now += 0.2
        progress.update()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "\r" not in out
    assert re.fullmatch(
        r"train: step 125/400 \(31%\) \| loss 0\.4321 \| 5\.0 steps/s \| elapsed 5\.0s \| ETA 55s\n", out
    ), out
    for _ in range(100):  # 20 s more: still inside the 30 s interval
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out == ""
    for _ in range(50):  # past it: one more line
        fake_time.now += 0.2
        progress.update()
    assert capsys.readouterr().out.count("train: step") == 1
    while progress.step < 400:  # the last step always gets its line
        progress.update()
    assert capsys.readouterr().out.startswith("train: step 400/400 (100%)")
    progress.write("checkpoint: step 400 saved to somewhere")
    assert capsys.readouterr().out == "checkpoint: step 400 saved to somewhere\n"


def test_slow_steps_are_shown_in_seconds_per_step(fake_time: Clock) -> None:
    progress = Progress(total=10, initial=0, enabled=True)
    fake_time.now += 40.0
    progress.update()
    assert "| 40.0 s/step | elapsed 40s | ETA 6m00s" in progress.line()


def test_with_max_time_lost_the_line_says_what_a_kill_now_would_cost(fake_time: Clock) -> None:
    progress = Progress(total=10, initial=0, enabled=True, at_risk=lambda: 40.0)
    fake_time.now += 1.0
    progress.update()
    assert progress.line().endswith("| ETA 9.0s | at risk 40s")


def test_processes_other_than_the_main_one_print_nothing(
    fake_time: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    progress = Progress(total=5, initial=0, enabled=False)
    for _ in range(5):
        fake_time.now += 100
        progress.update()
    progress.write("checkpoint: step 5 saved")
    assert capsys.readouterr() == ("", "")
