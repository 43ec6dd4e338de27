"""Never lose work: a stopped, killed or damaged run continues exactly where it was.

Every test compares against an uninterrupted reference run with the same arguments: dropout is on,
the training images get random noise, and accumulation is 2 in 1 and in 2 processes.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    checkpoint_problem,
    checkpoint_step,
    list_checkpoints,
)
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from ..conftest import (
    assert_same_run,
    last_eval,
    read_metrics,
    run_training,
    start_training,
    wait_for_training,
)

pytestmark = pytest.mark.slow

# 8 epochs of 22 optimizer steps; slow enough (a few seconds) to be hit by a signal mid-run.
EXACT = ["--num_epochs", "8", "--hidden_size", "512", "--log_every", "5", "--checkpoint_every", "20"]
PER_DEVICE = {1: ["--per_device_batch_size", "32"], 2: ["--per_device_batch_size", "16"]}  # accumulation 2
TOTAL_STEPS = 176


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """An uninterrupted run, in 1 or 2 processes."""
    processes = request.param
    output_dir = tmp_path_factory.mktemp(f"reference{processes}") / "run"
    result = run_training(output_dir, *EXACT, *PER_DEVICE[processes], processes=processes)
    assert f"x {processes} processes x 2 accumulation = global batch 64" in result.stdout
    return processes, output_dir


def test_resume_after_max_steps_mid_epoch_and_at_epoch_end_is_exact(
    reference: tuple[int, Path], tmp_path: Path
) -> None:
    processes, reference_dir = reference
    output_dir = tmp_path / "run"
    args = [*EXACT, *PER_DEVICE[processes]]
    # Step 30 is mid-epoch (epoch 1), step 66 ends epoch 2; neither is a multiple of checkpoint_every.
    first = run_training(output_dir, *args, "--max_steps", "30", processes=processes)
    assert "starting fresh" in first.stdout
    run_training(output_dir, *args, "--max_steps", "66", processes=processes)
    last = run_training(output_dir, *args, processes=processes)
    assert "resuming from" in last.stdout and "step_00000066" in last.stdout
    assert_same_run(output_dir, reference_dir)


def launcher_forwards_sigusr1() -> bool:
    """Whether torch's launcher has --signals-to-handle (torch >= 2.10), which PET_SIGNALS_TO_HANDLE sets."""
    from torch.distributed.run import get_args_parser

    return any("--signals-to-handle" in action.option_strings for action in get_args_parser()._actions)


# SIGTERM on 1 and 2 processes: tests/test_guarantees.py.
# SIGHUP: a closed terminal (the launcher passes it on to every process, as SIGINT). On 1 process the three
# signals stop one run in turn: the run ends as the reference only if each resume was exact. SIGINT and
# SIGHUP go to the launcher like SIGTERM: on 2 processes, SIGUSR1 alone.
def test_signals_stop_save_and_resume_exactly(reference: tuple[int, Path], tmp_path: Path) -> None:
    processes, reference_dir = reference
    stops = [signal.SIGINT, signal.SIGUSR1, signal.SIGHUP] if processes == 1 else [signal.SIGUSR1]
    if processes == 2 and not launcher_forwards_sigusr1():
        pytest.skip(
            "this torch's launcher dies of SIGUSR1 (it passes it on from torch 2.10); the SLURM batch script "
            "gives a multi-process step SIGTERM instead (tests/test_launchers.py)"
        )
    output_dir = tmp_path / "run"
    args = [*EXACT, *PER_DEVICE[processes]]
    stopped_at = 0
    for stop_signal in stops:
        started = time.time()
        process = start_training(output_dir, *args, processes=processes)
        # An arbitrary moment, not aligned with any step: a random logged step, then a fraction of a step.
        wait_for_training(output_dir, process, since=started, step=stopped_at + random.randrange(5, 35, 5))
        assert process.poll() is None, "train.py ended before it was signalled"
        time.sleep(random.uniform(0.0, 0.02))
        process.send_signal(stop_signal)
        sent = 1
        if processes == 1:
            time.sleep(0.2)  # a second signal, likely while the checkpoint is written: must change nothing
            if process.poll() is None:
                process.send_signal(stop_signal)
                sent += 1
        output, _ = process.communicate(timeout=120)
        if stopped_at:
            assert f"resuming from {output_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in output
        # One line for the signal, from rank 0 alone: the launcher forwards it to every process.
        assert output.count(f"{stop_signal.name} received: saving a checkpoint") == 1, output[-2000:]
        assert output.count("received again") <= sent - 1, output[-2000:]
        assert "checkpoint saved, run the same command to continue" in output, output[-2000:]
        # A single process exits with EXIT_STOPPED; the launcher reports the signal it got (non-zero).
        assert process.returncode == (EXIT_STOPPED if processes == 1 else 1), output[-2000:]
        stopped_at = max(int(path.name[5:]) for path in list_checkpoints(output_dir))
        assert stopped_at < TOTAL_STEPS and not (output_dir / "model").exists()
    resumed = run_training(output_dir, *args, processes=processes)
    assert f"resuming from {output_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in resumed.stdout
    assert_same_run(output_dir, reference_dir)


def test_repeated_kill_9_then_auto_resume_ends_bitwise_identical(
    reference: tuple[int, Path], tmp_path: Path
) -> None:
    processes, reference_dir = reference
    if processes == 2:
        pytest.skip("kill -9 of one process of a group is a crash of the group; covered in 1 process")
    output_dir = tmp_path / "run"
    args = [*EXACT, *PER_DEVICE[1], "--checkpoint_every", "7"]
    rng = random.Random(1234)
    kills_during_training = 0
    for attempt in range(6):
        started = time.time()
        process = start_training(output_dir, *args)
        if attempt % 3 == 2:
            # During start-up or while loading the checkpoint; at the latest as training starts (a fast
            # machine trains the whole run in a few seconds).
            deadline = time.monotonic() + rng.uniform(0.3, 3.0)
            log = output_dir / "metrics.jsonl"
            while time.monotonic() < deadline and not (log.exists() and log.stat().st_mtime > started):
                time.sleep(0.01)
        else:
            # A few logged steps past the newest checkpoint, however fast this machine trains, then a
            # moment more: mid-step, mid-log or mid-save.
            saved = list_checkpoints(output_dir)
            resumed_at = checkpoint_step(saved[-1]) if saved else 0
            wait_for_training(output_dir, process, since=started, step=resumed_at + rng.choice([5, 10, 15]))
            time.sleep(rng.uniform(0.0, 0.05))
            kills_during_training += 1
        if process.poll() is not None:
            break
        process.kill()
        process.wait()
        # Whatever was interrupted, every published checkpoint is whole.
        for path in list_checkpoints(output_dir):
            assert checkpoint_problem(path) is None, path
    assert kills_during_training >= 3
    run_training(output_dir, *args)
    # checkpoint_every does not change the training itself, so the reference still applies.
    assert_same_run(output_dir, reference_dir)


def test_damaged_newest_checkpoints_fall_back_to_an_older_one(
    reference: tuple[int, Path], tmp_path: Path
) -> None:
    processes, reference_dir = reference
    if processes == 2:
        pytest.skip("the fallback is decided before any process-specific work; covered in 1 process")
    output_dir = tmp_path / "run"
    shutil.copytree(reference_dir, output_dir)
    shutil.rmtree(output_dir / "model")
    newest, second, third = list_checkpoints(output_dir)[::-1][:3]
    weights = newest / "model.safetensors"
    weights_size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: weights_size // 2])  # truncated copy
    (second / "loop_state.json").write_text('{"loop_state": {"step": ')  # torn write
    staging = output_dir / "checkpoints" / ".incomplete_step_00000999"  # a save killed half-way
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")

    problems = [checkpoint_problem(path) for path in (newest, second, third)]
    assert "model.safetensors has" in str(problems[0]) and "loop_state.json is damaged" in str(problems[1])
    assert problems[2] is None and staging not in list_checkpoints(output_dir)

    result = run_training(output_dir, *EXACT, *PER_DEVICE[1])
    assert f"WARNING: skipping checkpoint {newest}: model.safetensors has" in result.stdout
    assert f"WARNING: skipping checkpoint {second}: loop_state.json is damaged" in result.stdout
    assert f"resuming from {third}" in result.stdout
    assert_same_run(output_dir, reference_dir)
    # The damaged checkpoints were set aside as they were (never deleted); the run's own unfinished save
    # (the staging folder) was removed, and every checkpoint in place is sound.
    (aside,) = (output_dir / "set_aside").iterdir()
    assert (aside / "checkpoints" / newest.name / "model.safetensors").stat().st_size == weights_size // 2
    assert (aside / "checkpoints" / second.name / "loop_state.json").read_text() == '{"loop_state": {"step": '
    assert f"set aside the unreadable checkpoint(s) {second.name}, {newest.name} to {aside}" in result.stdout
    assert not staging.exists()
    assert all(checkpoint_problem(path) is None for path in list_checkpoints(output_dir))


def test_checkpoint_moves_to_another_world_size(reference: tuple[int, Path], tmp_path: Path) -> None:
    """2 -> 1 and 1 -> 2 processes: same global batch, same samples seen, close to the reference."""
    processes, reference_dir = reference
    other = 3 - processes
    output_dir = tmp_path / "run"
    shutil.copytree(reference_dir, output_dir)
    shutil.rmtree(output_dir / "model")
    oldest, *newer = list_checkpoints(output_dir)
    for path in newer:
        shutil.rmtree(path)
    result = run_training(output_dir, *EXACT, *PER_DEVICE[processes], processes=other)
    accumulation = 2 * processes // other
    assert f"x {other} processes x {accumulation} accumulation = global batch 64" in result.stdout
    per_device = PER_DEVICE[processes][1]
    assert (
        f"history: processes {processes} -> {other}, accumulation 2 -> {accumulation} (per-device batch "
        f"{per_device} kept): the same samples and random numbers" in result.stdout
    )
    assert f"resuming from {oldest}" in result.stdout
    resumed, expected = read_metrics(output_dir), read_metrics(reference_dir)
    last_train = [row for row in resumed if "train/samples_seen" in row][-1]
    assert last_train["step"] == TOTAL_STEPS and last_train["train/samples_seen"] == TOTAL_STEPS * 64
    assert [row["step"] for row in resumed] == [row["step"] for row in expected]
    assert last_eval(output_dir)["eval/loss"] == pytest.approx(last_eval(reference_dir)["eval/loss"], rel=0.1)
    assert last_eval(output_dir)["eval/accuracy"] == pytest.approx(
        last_eval(reference_dir)["eval/accuracy"], abs=0.02
    )


def test_a_checkpoint_records_its_world_size_precision_and_platform(reference: tuple[int, Path]) -> None:
    processes, reference_dir = reference
    newest = list_checkpoints(reference_dir)[-1]
    assert newest.name == f"step_{TOTAL_STEPS:08d}" and checkpoint_problem(newest) is None
    session = json.loads((newest / "history.json").read_text())["sessions"][-1]
    recorded = (session["processes"], session["mixed_precision"], session["platform"])
    assert recorded == (processes, "no", "local")
    assert {"python", "torch", "accelerate"} <= set(session["versions"])
