"""Going back in a run, with real runs on the CPU (docs/resume.md, "Go back, or train longer"):

- `--resume_from STEP` continues from that checkpoint exactly as any resume does; the checkpoints and
  exports after it are set aside, not deleted; history.json records the branch; the same command run again
  continues the branch instead of throwing it away; a bad value is one line and changes nothing;
- a branch may change the learning rate (refused without --resume_from): the schedule applies to the new
  peak, history.json names the change, and the branch killed, stopped by SIGTERM and rerun with plain
  commands ends bitwise as if never stopped;
- `lr_schedule: wsd`: a run planned for fewer steps and rerun with more continues from the checkpoint
  where its decay began (kept by rotation) and ends bitwise equal to a run planned that long from the start,
  also when the longer session runs on 2 processes; with cosine that rerun is one line naming wsd.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import checkpoint_step, list_checkpoints
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import (
    assert_same_run,
    read_metrics,
    run_training,
    sessions_of,
    start_training,
    wait_for_training,
)

# The longest run here, in optimizer steps, and its parts: a fixed count, as a task's own SIGNAL_RUN may
# give epochs instead of --max_steps (tests/own_task), and few, as the branches need no length.
LONG = 40
EVERY = str(LONG // 8)  # a checkpoint every this many steps
ARGS = ["--checkpoint_every", EVERY, "--keep_checkpoints", "8", "--log_every", "5", "--warmup_steps", "5"]


def steps(output_dir: Path) -> list[int]:
    return [checkpoint_step(path) for path in list_checkpoints(output_dir)]


def tree(folder: Path) -> dict[str, int]:
    """Every file below `folder` (but the lock, which every start takes) and its modification time: what a
    refused run must leave as it was."""
    return {str(path): path.stat().st_mtime_ns for path in sorted(folder.rglob("*")) if path.name != ".lock"}


@pytest.mark.slow
def test_resume_from_a_step_branches_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mirror = ["--mirror_dir", str(tmp_path / "mirror")]
    run_training(run, *ARGS, *mirror, "--max_steps", str(LONG // 2))
    shutil.copytree(run, tmp_path / "copy")  # the run before the branch, as an import_from would hold it
    first = steps(run)
    back = first[0]
    length = ["--max_steps", str(first[1])]  # the branch ends before the run it left did
    resumed = run_training(run, *ARGS, *mirror, *length, "--resume_from", str(back)).stdout
    assert f"resuming from {run / 'checkpoints' / f'step_{back:08d}'} (step {back}," in resumed, resumed
    # Set aside, not deleted: every later checkpoint and the exports of the later step, as they were.
    aside = next((run / "set_aside").iterdir())
    assert sorted(checkpoint_step(path) for path in (aside / "checkpoints").iterdir()) == first[1:]
    assert json.loads((aside / "model" / "export.json").read_text())["step"] == LONG // 2
    branch = sessions_of(run)[-1]["branch"]
    assert branch["from_step"] == back and branch["folder"] == str(aside), branch
    assert branch["set_aside"][: len(first) - 1] == [f"step_{step:08d}" for step in first[1:]]
    # The mirror holds the branch, its earlier checkpoints set aside there too.
    assert steps(tmp_path / "mirror") == steps(run) == first[:2]
    assert (tmp_path / "mirror" / "set_aside").is_dir()
    # Bitwise as the run that never went back: the same checkpoint, resumed as any other.
    reference = tmp_path / "reference"
    run_training(reference, *ARGS, *length)
    assert_same_run(run, reference)
    # A newer copy of the branch left behind is not brought back.
    again = run_training(run, *ARGS, *length, "--import_from", str(tmp_path / "copy")).stdout
    assert f"a branch set aside at step {back}" in again and steps(run) == first[:2], again
    # The same command again (a notebook cell rerun) continues the branch: nothing more is set aside.
    again = run_training(run, *ARGS, *length, "--resume_from", str(back)).stdout
    assert "this branch was made already" in again and "branching" not in again, again
    assert len(list((run / "set_aside").iterdir())) == 1


@pytest.mark.slow
def test_resume_from_bad_values_are_one_line_and_change_nothing(tmp_path: Path, single_run: tuple) -> None:
    run = tmp_path / "run"
    length = ["--max_steps", EVERY]
    run_training(run, *ARGS, *length)
    before = tree(run)
    held = ", ".join(map(str, steps(run)))
    foreign = list_checkpoints(single_run[0])[0]  # the shared run's: another run
    for value, expected in [
        ("7", f"resume_from 7: no such checkpoint: give one of output_dir's checkpoint steps ({held})"),
        (str(foreign), f"resume_from {foreign}: it is of another run"),
        (str(tmp_path / "nowhere"), f"resume_from {tmp_path / 'nowhere'}: not a step number nor a"),
    ]:
        result = run_training(run, *ARGS, *length, "--resume_from", value, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and lines[-1].startswith(f"config error: {expected}"), result.stderr
        assert tree(run) == before
    # A checkpoint that does not verify is named, with the steps there are.
    newest = list_checkpoints(run)[-1]
    (newest / "loop_state.json").write_text("{}")
    result = run_training(run, *ARGS, *length, "--resume_from", str(checkpoint_step(newest)), check=False)
    assert f"checkpoint {newest.name} cannot be read" in result.stderr.splitlines()[-1], result.stderr
    # In an empty output_dir: refused before the folder is made.
    fresh = tmp_path / "fresh"
    result = run_training(fresh, *ARGS, *length, "--resume_from", "3", check=False)
    assert "resume_from 3: no such checkpoint" in result.stderr and not fresh.exists(), result.stderr


@pytest.mark.slow
def test_a_branch_may_lower_the_learning_rate_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_training(run, *ARGS, "--max_steps", str(LONG // 4), "--learning_rate", "0.003")
    shutil.copytree(run, tmp_path / "reference")
    before = {row["step"]: row["train/lr"] for row in read_metrics(run) if "train/lr" in row}
    back = steps(run)[0]
    branch = ["--learning_rate", "0.001", "--max_steps", str(LONG // 2)]
    # Without --resume_from: refused in one line that names it.
    result = run_training(run, *ARGS, *branch, check=False)
    line = result.stderr.strip().splitlines()[-1]
    assert "learning_rate 0.003 -> 0.001 (changed only by going back, with --resume_from STEP)" in line, line
    # The branch, killed before its first checkpoint, stopped by SIGTERM, then rerun: plain commands with
    # the branch's rate continue it.
    unsaved = ["--max_time_lost", "", "--checkpoint_every", str(LONG)]  # no checkpoint before the kill
    for stop, extra in [(signal.SIGKILL, ["--resume_from", str(back), *unsaved]), (signal.SIGTERM, [])]:
        since = time.time()
        process = start_training(run, *ARGS, *branch, *extra)
        wait_for_training(run, process, since, step=back + 10)
        process.send_signal(stop)
        output = process.communicate(timeout=300)[0]
        if stop == signal.SIGKILL:
            assert "history: learning rate 0.003 -> 0.001: set at a branch" in output, output
            assert steps(run) == [back], output  # later ones set aside; none of the branch's yet
    assert process.returncode == EXIT_STOPPED, output[-3000:]
    run_training(run, *ARGS, *branch)
    assert [session["learning_rate"] for session in sessions_of(run)] == [0.003, 0.001, 0.001, 0.001]
    # The schedule's factor applies to the new peak from the branch on.
    after = {row["step"]: row["train/lr"] for row in read_metrics(run) if "train/lr" in row}
    shared = [step for step in before if step > back]
    assert shared and all(after[step] == pytest.approx(before[step] / 3, rel=1e-9) for step in shared)
    assert all(after[step] == before[step] for step in before if step <= back)
    # Bitwise as the same branch never stopped.
    run_training(tmp_path / "reference", *ARGS, *branch, "--resume_from", str(back))
    assert_same_run(run, tmp_path / "reference")


@pytest.mark.slow
def test_wsd_grows_bitwise_and_cosine_refuses(tmp_path: Path) -> None:
    short = ["--max_steps", str(LONG // 2)]
    long = ["--max_steps", str(LONG * 3 // 4)]
    wsd = ["--lr_schedule", "wsd", "--log_every", "5", "--warmup_steps", "5", "--keep_checkpoints", "1"]
    grown = tmp_path / "grown"
    run_training(grown, *wsd, *short)
    decay = LONG // 2 - round(0.2 * (LONG // 2))
    assert decay in steps(grown), steps(grown)  # saved between intervals, and not rotated away
    resumed = run_training(grown, *wsd, *long, processes=2).stdout
    assert f"continuing from step {decay}, before the decay" in resumed, resumed
    assert sessions_of(grown)[-1]["branch"]["from_step"] == decay
    planned = tmp_path / "planned"
    run_training(planned, *wsd, *long)
    assert_same_run(grown, planned)
    # A cosine schedule cannot grow: one line that names the schedule that can.
    cosine = tmp_path / "cosine"
    run_training(cosine, "--num_epochs", "1", "--log_every", "5")
    result = run_training(cosine, "--num_epochs", "2", "--log_every", "5", check=False)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and line.startswith("config error: ") and "lr_schedule: wsd" in line, line
