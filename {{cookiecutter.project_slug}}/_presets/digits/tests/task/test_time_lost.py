"""max_time_lost and stop signals in real runs (training/timing.py): a first step as slow as compiling a
model, a CPU load that comes and goes, SIGKILLs at random moments, then reruns to a bitwise-identical end;
and a stop signal acted on within a second, on 1 and 2 processes, whatever log_every is."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_step, list_checkpoints
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED
from {{ cookiecutter.package_name }}.utils.training.timing import LOOP_SHARE

from ..conftest import PROJECT, assert_same_run, run_training, training_command

pytestmark = pytest.mark.slow

# A sitecustomize: a slow first step ($FIRST_STEP_S), and each step's time and "at risk" in $TIMING_MARKS.
HOOK = Path(__file__).parent / "timing_hook"
LOST_S = 10.0  # max_time_lost of these runs; the first step takes FIRST_STEP_S of it, as a compile would
FIRST_STEP_S = 8.0
# The schedule is num_epochs' (22 steps each): max_steps only ends the last session, where the test says.
ARGS = ["--num_epochs", "1000", "--log_every", "50", "--mixed_precision", "no", "--max_time_lost", "10s"]


def hooked(
    monkeypatch: pytest.MonkeyPatch,
    marks: Path,
    first_step_s: float,
    output_dir: Path,
    *args: str,
    processes: int = 1,
) -> subprocess.Popen[str]:
    """train.py started with the hook, writing to `marks`, in fresh interpreters (forked runs have none)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TIMING_MARKS", str(marks))
    monkeypatch.setenv("FIRST_STEP_S", str(first_step_s))
    command, env = training_command(output_dir, *args, processes=processes)
    return subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def read_marks(marks: Path) -> tuple[float, dict[int, tuple[float, float]], list[tuple[int, float]]]:
    """When the loop started; step -> (wall time reached, at risk then); each checkpoint's step, loop stop."""
    lines = [line.split() for line in marks.read_text().splitlines()]
    started = next(float(line[2]) for line in lines if line[0] == "start")
    steps = {
        int(line[1]): (float(line[2]), float(line[3]))
        for line in lines
        if line[0] == "step" and len(line) == 4
    }
    stops = [(int(line[1]), float(line[2])) for line in lines if line[0] == "stop" and len(line) == 3]
    return started, steps, stops


def wait_for_step(marks: Path, process: subprocess.Popen, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (
        marks.exists() and any(line.startswith(f"step {step} ") for line in marks.read_text().splitlines())
    ):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"train.py did not reach step {step}"
        time.sleep(0.05)


def check_session(marks: Path, first_step_s: float) -> tuple[dict[int, tuple[float, float]], float]:
    """A session's marks: one checkpoint in its first 50 steps (after its slow first step, not one at each),
    "at risk" never over max_time_lost plus its longest step (the slow first one left out), and the loop
    stopped for checkpoints at most 2% of the time. Returns its steps and that longest step."""
    started, steps, stops = read_marks(marks)
    first = min(steps)
    assert steps[first][0] - started >= first_step_s
    assert [step for step, _ in stops if step < first + 50] == [first], stops
    longest = max(steps[step][0] - steps[step - 1][0] for step in steps if step - 1 in steps)
    worst = max(risk for _, risk in steps.values())
    assert worst <= LOST_S + longest, (worst, longest)
    training = max(time for time, _ in steps.values()) - started
    assert sum(seconds for _, seconds in stops) <= LOOP_SHARE * training, (stops, training)
    return steps, longest


def test_slow_first_steps_a_load_and_sigkills_lose_at_most_max_time_lost_then_end_bitwise_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions, each with an 8 s first step and SIGKILLed at a random moment (the first under a CPU load
    switched on and off), then one to the end: each kill lost at most max_time_lost plus a step, and the
    end is the uninterrupted run's, bit for bit."""
    chooser = random.Random(0)
    output_dir = tmp_path / "run"
    reached_last = 0
    for session, kill_after in enumerate((chooser.uniform(14, 20), chooser.uniform(3, 12))):
        marks = tmp_path / f"marks{session}"
        process = hooked(monkeypatch, marks, FIRST_STEP_S, output_dir, *ARGS)
        try:
            wait_for_step(marks, process, reached_last + 2)
            begun = time.time()
            load = []
            if session == 0:  # two busy processes on the machine's cores, for a few seconds
                busy = [sys.executable, "-c", "while True: pass"]
                load = [subprocess.Popen(busy) for _ in range(2)]
            while time.time() < begun + kill_after:
                time.sleep(0.05)
                if load and time.time() > begun + 6:
                    for each in load:
                        each.kill()
                        each.wait()
                    load = []
            assert process.poll() is None, "the session ended before its kill"
            process.kill()
            killed_at = time.time()
            process.wait()
        finally:
            for each in load:
                each.kill()
        steps, longest = check_session(marks, FIRST_STEP_S)
        resumed = checkpoint_step(list_checkpoints(output_dir)[-1])
        lost = killed_at - steps[resumed][0]  # the training the rerun does again
        assert lost <= LOST_S + longest, (lost, longest)
        reached_last = max(steps)
    end = ["--max_steps", str(reached_last + 100)]
    last = hooked(monkeypatch, tmp_path / "marks_last", FIRST_STEP_S, output_dir, *ARGS, *end)
    output = last.communicate(timeout=600)[0]
    assert last.returncode == 0, output[-3000:]
    check_session(tmp_path / "marks_last", FIRST_STEP_S)
    monkeypatch.undo()
    run_training(tmp_path / "reference", *ARGS, *end)  # forked: no hook
    assert_same_run(output_dir, tmp_path / "reference")


@pytest.mark.parametrize(
    ("processes", "stop"),
    [(1, signal.SIGTERM), (2, signal.SIGINT), (1, signal.SIGUSR1), (2, signal.SIGHUP), (2, None)],
    ids=["SIGTERM-1proc", "SIGINT-2proc", "SIGUSR1-1proc", "SIGHUP-2proc", "launcher-death-2proc"],
)
def test_a_stop_is_acted_on_within_two_seconds_whatever_log_every_is(
    processes: int, stop: signal.Signals | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log_every and eval_every 100,000 (neither comes in the run): a stop signal, or the launcher's death
    (None), is acted on within 2 s or one step, whichever is longer, with a checkpoint where it stopped."""
    marks = tmp_path / "marks"
    output_dir = tmp_path / "run"
    # No logging step and no evaluation (each acts on a stop) in the run
    args = ["--max_steps", "100000", "--num_epochs", "10000", "--log_every", "100000"]
    args += ["--eval_every", "100000"]
    process = hooked(monkeypatch, marks, 0.0, output_dir, *args, processes=processes)
    wait_for_step(marks, process, 200)
    sent = time.time()
    process.send_signal(stop or signal.SIGKILL)  # the launcher (2 processes), or the one process
    try:
        output = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
    deadline = time.monotonic() + 60  # after the launcher's death its processes go on without it
    while True:
        _, steps, _ = read_marks(marks)
        last = max(steps)
        saved = list_checkpoints(output_dir)
        if (saved and checkpoint_step(saved[-1]) == last) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    longest = max(steps[step][0] - steps[step - 1][0] for step in steps if step - 1 in steps)
    assert steps[last][0] - sent <= max(2.0, longest), (steps[last][0] - sent, longest)
    assert checkpoint_step(list_checkpoints(output_dir)[-1]) == last
    if stop is not None:
        said = f"{stop.name} received: saving a checkpoint within a second or a step, then stopping"
        assert said in output and f"stopped by {stop.name} at step {last}: checkpoint saved" in output, (
            output[-3000:]
        )
        assert process.returncode == (EXIT_STOPPED if processes == 1 else 1), output[-3000:]
