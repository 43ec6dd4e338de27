"""A run continues wherever a copy of it is: another session's output, a Drive mirror.

The platforms' folders are plain temporary folders laid out as the platform lays them out (Kaggle mounts
an earlier version's output under /kaggle/input/<notebook>/, holding what /kaggle/working held; Colab's
Drive is a folder that may fail). Every continued run must end exactly like the uninterrupted reference
(`single_run`, the QUICK settings: 88 optimizer steps, checkpoints every 20).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    LOOP_STATE_FILE,
    checkpoint_problem,
    export_problem,
    list_checkpoints,
)
from {{ cookiecutter.package_name }}.utils.checkpoints.mirror import Mirror
from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE

from ..conftest import assert_same_run, read_metrics, run_training, sessions_of
from ..task_settings import QUICK

pytestmark = pytest.mark.slow


def run_id(output_dir: Path) -> str:
    newest = list_checkpoints(output_dir)[-1]
    return json.loads((newest / LOOP_STATE_FILE).read_text())["loop_state"]["run_id"]


@pytest.fixture(scope="module")
def first_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kaggle session's /kaggle/working after a session that stopped at step 40 of 88."""
    working = tmp_path_factory.mktemp("session1") / "working"
    run_training(working / "outputs" / "run", *QUICK, "--max_steps", "40")
    return working


def test_a_new_session_continues_the_previous_versions_output_among_its_inputs(
    first_session: Path, single_run: tuple, tmp_path: Path
) -> None:
    """Kaggle: the previous version's output, attached as an input, is found and continued; the run ends
    bitwise equal to the uninterrupted one, and the launch says where it continued from and why."""
    inputs = tmp_path / "input"
    shutil.copytree(first_session, inputs / "my-notebook")  # what Kaggle mounts, read-only
    output_dir = tmp_path / "working" / "outputs" / "run"
    result = run_training(output_dir, *QUICK, "--import_from", str(inputs))
    source = inputs / "my-notebook" / "outputs" / "run"
    assert f"continuing from {source} (step 40, run {run_id(source)}): the newest copy" in result.stdout
    assert "resuming from" in result.stdout and "starting fresh" not in result.stdout
    assert_same_run(output_dir, single_run[0])
    assert run_id(output_dir) == run_id(source)  # the same run, continued
    # The copy carried the run's history: the first session, then this one.
    assert "history: session 2 of run" in result.stdout
    assert "(local, steps 0-40, max_steps reached)" in result.stdout
    assert [(s["start_step"], s["end_step"]) for s in sessions_of(output_dir)] == [(0, 40), (40, 88)]


def test_of_two_runs_with_these_settings_the_newest_copy_is_continued_and_named(
    first_session: Path, tmp_path: Path
) -> None:
    """Two runs that this config could both continue (the same settings and data: alike bitwise): the
    newest copy that verifies is continued, and the note names it."""
    inputs = tmp_path / "input"
    shutil.copytree(first_session, inputs / "version-1")
    run_training(inputs / "other" / "run", *QUICK, "--max_steps", "20")  # a second run, same settings
    output_dir = tmp_path / "working" / "run"
    result = run_training(output_dir, *QUICK, "--import_from", str(inputs))
    source = inputs / "version-1" / "outputs" / "run"
    assert f"continuing from {source} (step 40, run {run_id(source)}): the newest copy" in result.stdout
    assert run_id(output_dir) == run_id(source)


def test_a_run_with_other_settings_is_named_and_not_continued(first_session: Path, tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    other = ["--learning_rate", "0.001", "--max_steps", "5"]
    result = run_training(output_dir, *QUICK, *other, "--import_from", str(first_session))
    assert "other settings (learning_rate 0.003 -> 0.001 (changed only by going back" in result.stdout
    assert "starting fresh" in result.stdout


def test_resume_skips_a_mirror_checkpoint_that_arrived_in_part(
    first_session: Path, single_run: tuple, tmp_path: Path
) -> None:
    """A Colab runtime died while Drive uploaded its newest checkpoint: the new session (empty local disk)
    takes the newest mirror checkpoint that verifies, says which it skipped, and ends exactly; the broken
    copy is set aside in the mirror, not deleted."""
    mirror = tmp_path / "drive" / "run"
    shutil.copytree(first_session / "outputs" / "run", mirror)  # step 20 and step 40, as mirrored
    newest = mirror / "checkpoints" / "step_00000040"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # half uploaded
    (mirror / "checkpoints" / ".incomplete_step_00000060").mkdir()  # a copy cut off mid-way
    output_dir = tmp_path / "content" / "run"
    result = run_training(output_dir, *QUICK, "--mirror_dir", str(mirror))
    assert f"WARNING: skipping {mirror} (step 40" in result.stdout
    assert "model.safetensors has" in result.stdout
    assert f"continuing from {mirror} (step 20" in result.stdout
    assert_same_run(output_dir, single_run[0])
    # The mirror caught up: the final checkpoint verifies there, with the same metrics and exports.
    assert f"mirror: {mirror} holds step 88 (verified)" in result.stdout
    assert checkpoint_problem(list_checkpoints(mirror)[-1]) is None
    assert read_metrics(mirror) == read_metrics(output_dir)
    assert (mirror / "model" / "model.safetensors").read_bytes() == (
        output_dir / "model" / "model.safetensors"
    ).read_bytes()
    assert list((mirror / "set_aside").glob("*/checkpoints/step_00000040/model.safetensors"))


def damage(path: Path, how: str) -> None:
    """One bit flipped in the middle of `path`, or its second half cut off."""
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[len(data) // 2] ^= 1
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("where", "how"), [("import", "flipped"), ("mirror", "flipped"), ("import", "cut")])
def test_a_damaged_export_in_a_copy_is_named_and_not_brought_in(
    first_session: Path, tmp_path: Path, where: str, how: str
) -> None:
    """best_model/ of a run folder under import_from or of a Drive mirror does not match the checksums written
    at its export: the checkpoint (which verifies) is continued, the export is named and left out."""
    run = tmp_path / "copy" / "run"
    shutil.copytree(first_session / "outputs" / "run", run)
    damage(run / "best_model" / "model.safetensors", how)
    flags = ["--import_from", str(run.parent)] if where == "import" else ["--mirror_dir", str(run)]
    output_dir = tmp_path / "content" / "run"
    result = run_training(output_dir, *QUICK, "--max_steps", "40", *flags)
    named = f"WARNING: not bringing in best_model/ of {run}: best_model/model.safetensors "
    assert named in result.stdout, result.stdout[-3000:]
    assert ("does not match its checksum" if how == "flipped" else "bytes,") in result.stdout
    assert f"continuing from {run} (step 40" in result.stdout
    # What output_dir holds is this session's own evaluation's export (the checkpoint precedes the last
    # evaluation), whole and with its checksums.
    for export in ("model", "best_model"):
        assert export_problem(output_dir / export) is None


def test_a_done_run_whose_damaged_best_model_was_left_out_claims_none_at_the_end(
    single_run: tuple, tmp_path: Path
) -> None:
    """The mirror of a run that is done holds a best_model/ with a flipped bit: the session continued from it
    evaluates nothing new, so no best_model/ exists, and neither the export line nor the mirror's line
    claims one."""
    mirror = tmp_path / "drive" / "run"
    shutil.copytree(single_run[0], mirror)
    damage(mirror / "best_model" / "model.safetensors", "flipped")
    output_dir = tmp_path / "content" / "run"
    result = run_training(output_dir, *QUICK, "--mirror_dir", str(mirror))
    assert f"WARNING: not bringing in best_model/ of {mirror}" in result.stdout, result.stdout[-3000:]
    assert not (output_dir / "best_model").exists()
    (exported,) = [line for line in result.stdout.splitlines() if line.startswith("exported ")]
    assert exported.startswith(f"exported {output_dir / 'model'} (last step); no best_model/ of"), exported
    assert f"mirror: {mirror} holds step 88 (verified), the metrics, model/\n" in result.stdout


@pytest.mark.parametrize(
    ("file", "why"),
    [
        ("model.safetensors", "model.safetensors does not match its checksum"),
        (LOOP_STATE_FILE, f"its {LOOP_STATE_FILE} or config.yaml cannot be read"),
    ],
)
def test_a_copy_without_a_readable_checkpoint_is_named_and_nothing_is_written(
    first_session: Path, single_run: tuple, tmp_path: Path, file: str, why: str
) -> None:
    """Every checkpoint of the only copy is damaged (its weights, or its loop state cut short): one line
    names the copy and why, output_dir is not created; the same command with a good copy continues the
    run exactly."""
    bad = tmp_path / "bad" / "run"
    shutil.copytree(first_session / "outputs" / "run", bad)
    for checkpoint in list_checkpoints(bad):
        damage(checkpoint / file, "flipped" if file == "model.safetensors" else "cut")
    output_dir = tmp_path / "working" / "run"
    result = run_training(output_dir, *QUICK, "--import_from", str(bad.parent), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: no copy of this run verifies, so none was brought in ({bad} (step 40")
    assert why in line and "--import_from" in line
    assert not output_dir.exists()
    shutil.rmtree(bad.parent)
    shutil.copytree(first_session / "outputs" / "run", bad)  # the good copy, where the bad one was
    result = run_training(output_dir, *QUICK, "--import_from", str(bad.parent))
    assert f"continuing from {bad} (step 40" in result.stdout
    assert_same_run(output_dir, single_run[0])


def test_training_goes_on_while_the_mirror_cannot_be_written(single_run: tuple, tmp_path: Path) -> None:
    """Drive's mount is gone (a file where the folder was): one warning, training finishes and exports,
    and the end says the persistent copy is behind."""
    mirror = tmp_path / "drive"
    mirror.write_text("not a folder")
    result = run_training(tmp_path / "run", *QUICK, "--mirror_dir", str(mirror))
    assert result.stdout.count("mirror: WARNING: cannot copy") == 1, result.stdout
    assert "done: 88 optimizer steps" in result.stdout
    behind = f"mirror: WARNING: {mirror} is behind (newest verified checkpoint: none; output_dir: step 88)"
    assert behind in result.stdout


def test_an_unwritable_mirror_still_names_the_step_it_holds(
    first_session: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An earlier session's mirror holds step 20 of this run, and cannot be written now (its lock file is a
    folder): the end of the run says the mirror is behind at step 20, not that it holds none."""
    local = tmp_path / "local"
    shutil.copytree(first_session / "outputs" / "run", local)
    target = tmp_path / "drive"
    shutil.copytree(local, target)
    shutil.rmtree(target / "checkpoints" / "step_00000040")  # the mirror had not caught up
    (target / LOCK_FILE).unlink(missing_ok=True)
    (target / LOCK_FILE).mkdir()
    mirror = Mirror(local, str(target), keep=2, enabled=True)
    mirror.start(run_id(local), start_over=False)
    mirror.finish()
    out = capsys.readouterr().out
    assert out.count("mirror: WARNING: cannot copy") == 1, out
    behind = f"mirror: WARNING: {target} is behind (newest verified checkpoint: step 20; output_dir: step 40)"
    assert behind in out


def wait_for(output: pytest.CaptureFixture[str], text: str, seen: list[str]) -> None:
    deadline = time.monotonic() + 60
    while not any(text in line for line in seen):
        assert time.monotonic() < deadline, f"no {text!r} in {seen}"
        time.sleep(0.02)
        seen.extend(output.readouterr().out.splitlines())


def test_mirror_failing_mid_run_reports_once_retries_and_catches_up(
    first_session: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mirror's folder disappears after a checkpoint reached it (replaced by a file: CI runs as root,
    so permissions would not fail a write), more checkpoints come, then the folder comes back."""
    local = tmp_path / "local"
    shutil.copytree(first_session / "outputs" / "run", local)
    later = local / "checkpoints" / "step_00000040"
    parked = tmp_path / "parked_step_40"
    later.rename(parked)  # the session has reached step 20 only
    target = tmp_path / "drive"
    mirror = Mirror(local, str(target), keep=2, enabled=True)
    mirror.start(run_id(local), start_over=False)
    mirror.request()
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while mirror.newest_step != 20:
        assert time.monotonic() < deadline, seen
        time.sleep(0.02)

    target.rename(tmp_path / "drive_away")
    target.write_text("the mount dropped")
    parked.rename(later)  # step 40 is saved while Drive is gone
    mirror.request()
    wait_for(capsys, "WARNING: cannot copy", seen)
    mirror.request()  # the next checkpoint: still failing, not reported again
    time.sleep(0.5)
    seen.extend(capsys.readouterr().out.splitlines())

    target.unlink()
    (tmp_path / "drive_away").rename(target)
    mirror.request()
    wait_for(capsys, "works again: step 40 copied and verified", seen)
    mirror.finish()
    seen.extend(capsys.readouterr().out.splitlines())
    assert sum("WARNING: cannot copy" in line for line in seen) == 1, seen
    assert f"mirror: {target} holds step 40 (verified), the metrics, model/, best_model/" in seen
    assert [path.name for path in list_checkpoints(target)] == ["step_00000020", "step_00000040"]
    assert all(checkpoint_problem(path) is None for path in list_checkpoints(target))
    assert (target / "metrics.jsonl").read_bytes() == (local / "metrics.jsonl").read_bytes()
