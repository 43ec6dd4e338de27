"""Faults and bad input, tried as a careful user would: nothing of a run is ever lost or mixed.

Each test starts train.py for real (a subprocess, this task's model and data, a few optimizer steps) and
checks the outcome: a one-line message that names the problem and the fix, a non-zero exit, and files
that are byte for byte what they were, or set aside (never deleted) where the user asked to start over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from subprocess import DEVNULL, PIPE

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    CHECKSUM,
    LOOP_STATE_FILE,
    STAGING_PREFIX,
    checkpoint_problem,
    checkpoint_root,
    file_xxh3,
    list_checkpoints,
    seal,
)
from {{ cookiecutter.package_name }}.utils.checkpoints.durable import TEMPORARY_PREFIX
from {{ cookiecutter.package_name }}.utils.checkpoints.persist import PAUSE_ENV
from {{ cookiecutter.package_name }}.utils.run import run_dir
from {{ cookiecutter.package_name }}.utils.run.run_dir import LOCK_FILE, SET_ASIDE, FolderInUse, OutputLock, set_aside
from {{ cookiecutter.package_name }}.utils.training.signals import EXIT_STOPPED

from .conftest import (
    PROJECT,
    SIGNAL_RUN,
    assert_same_run,
    read_metrics,
    run_training,
    training_command,
    wait_for_checkpoint,
    wait_for_training,
)

pytestmark = pytest.mark.slow

# A few optimizer steps with a checkpoint every two, for every task: the faults, not the training, matter.
FAST = ["--max_steps", "6", "--log_every", "2", "--checkpoint_every", "2", "--keep_checkpoints", "2"]
OTHER_LR = str(2 * task.Config().learning_rate)  # a setting other than the task's


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def refused(result: subprocess.CompletedProcess[str], *parts: str) -> str:
    """Assert a one-line refusal (exit 1, no traceback) that contains `parts`; return its line."""
    assert result.returncode == 1, (
        f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(("error: ", "config error: ")), line
    for part in parts:
        assert part in line, f"{part!r} not in: {line}"
    return line


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete FAST run: checkpoints, model/, best_model/, metrics.jsonl."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    run_training(output_dir, *FAST)
    return output_dir


@pytest.fixture
def copy_of(finished: Path, tmp_path: Path) -> Path:
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    return output_dir


def test_unreadable_checkpoints_are_refused_then_set_aside_on_request(copy_of: Path) -> None:
    """Torn loop states and one from an unknown newer version: nothing starts, nothing is deleted."""
    newest, older = list_checkpoints(copy_of)[::-1]
    (newest / LOOP_STATE_FILE).write_text('{"loop_state": {"step": ')
    record = json.loads((older / LOOP_STATE_FILE).read_text())
    record["loop_state"]["field_of_a_newer_version"] = 1
    (older / LOOP_STATE_FILE).write_text(json.dumps(record))
    before = snapshot(copy_of)

    line = refused(run_training(copy_of, *FAST, check=False), "no checkpoint in", "--start_over true")
    assert f"{newest.name} ({LOOP_STATE_FILE} is damaged" in line
    assert f"{older.name} ({LOOP_STATE_FILE} was written by another version" in line
    assert snapshot(copy_of) == before

    result = run_training(copy_of, *FAST, "--start_over", "true")
    assert "start_over: moved the earlier run" in result.stdout
    (aside,) = (copy_of / SET_ASIDE).iterdir()
    assert snapshot(aside) == before  # every file of the earlier run, byte for byte
    assert all(checkpoint_problem(path) is None for path in list_checkpoints(copy_of))


def test_refused_runs_write_nothing(copy_of: Path) -> None:
    """Other settings, deleted checkpoints: refused, and no file changes (config.yaml too)."""
    before = snapshot(copy_of)
    line = refused(run_training(copy_of, *FAST, "--learning_rate", OTHER_LR, check=False), "learning_rate")
    assert "holds a run with other settings" in line
    assert snapshot(copy_of) == before

    shutil.rmtree(copy_of / "checkpoints")
    before = snapshot(copy_of)
    result = run_training(copy_of, *FAST, "--learning_rate", OTHER_LR, check=False)
    line = refused(result, "holds an earlier run")
    assert "metrics.jsonl" in line and "model" in line
    assert snapshot(copy_of) == before

    run_training(copy_of, *FAST, "--learning_rate", OTHER_LR, "--start_over", "true")
    (aside,) = (copy_of / SET_ASIDE).iterdir()
    assert snapshot(aside) == before  # the earlier run, whole and apart: its metrics are not mixed in
    assert {row["step"] for row in read_metrics(copy_of)} == {2, 4, 6}


def test_a_restart_before_the_first_checkpoint_sets_earlier_outputs_aside(copy_of: Path) -> None:
    """No checkpoints/ and no model/ (deleted), the same settings: the run starts again, as one stopped
    before its first checkpoint, but first moves best_model/ and the metrics it would overwrite
    to set_aside/, byte for byte."""
    shutil.rmtree(copy_of / "checkpoints")
    shutil.rmtree(copy_of / "model")
    before = snapshot(copy_of)
    result = run_training(copy_of, *FAST)
    restarted = "holds this run stopped before its first checkpoint: starting it again; its outputs so far"
    assert restarted in result.stdout
    (aside,) = (copy_of / SET_ASIDE).iterdir()
    assert snapshot(aside) == {name: sha for name, sha in before.items() if name != "config.yaml"}
    assert "best_model/model.safetensors" in snapshot(aside)


def test_two_set_asides_within_one_second_keep_both(tmp_path: Path) -> None:
    """A run killed before its first checkpoint and restarted at once sets its files aside twice in one
    second: the second set-aside must not replace the first one's files."""
    for text in ("first", "second"):
        (tmp_path / "metrics.jsonl").write_text(text)
        set_aside([tmp_path / "metrics.jsonl"], tmp_path, stamp="20260101-000000")
    kept = sorted(path.read_text() for path in (tmp_path / SET_ASIDE).glob("*/metrics.jsonl"))
    assert kept == ["first", "second"]


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("random_states_0.pkl", "flip", "random_states_0.pkl does not match its checksum"),
        ("model.safetensors", "flip", "model.safetensors does not match its checksum"),
        ("config.yaml", "garble", "config.yaml does not match its checksum"),
        # The file that holds the others' checksums: a same-size edit of the position in the data.
        (LOOP_STATE_FILE, "edit", f"{LOOP_STATE_FILE} does not match its seal"),
    ],
)
def test_damage_of_the_right_size_is_caught_by_checksums(
    copy_of: Path, name: str, damage: str, message: str
) -> None:
    """A byte flipped in the RNG state, the weights or the config, or a digit of samples_seen changed in the
    loop state: that checkpoint is skipped, with the file named, the older one continues, and the damaged
    one is set aside intact."""
    shutil.rmtree(copy_of / "model")
    (copy_of / "curves.png").unlink()  # drawn again, after the divergence too
    newest, older = list_checkpoints(copy_of)[::-1]
    target = newest / name
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "edit":
        digit = re.search(rb'"samples_seen": \d*(\d)', data).start(1)  # its last digit
        data[digit] = ord("0") + (data[digit] - ord("0") + 1) % 10
    else:
        data[:6] = b"{[:]}\n"
    target.write_bytes(bytes(data))
    result = run_training(copy_of, *FAST)
    assert f"WARNING: skipping checkpoint {newest}: {message}" in result.stdout
    assert f"resuming from {older}" in result.stdout
    aside = next((copy_of / SET_ASIDE).iterdir()) / "checkpoints" / newest.name
    assert (aside / name).read_bytes() == bytes(data)


def test_divergence_stops_without_checkpoint_or_export(tmp_path: Path) -> None:
    """learning_rate 1e6: a clear stop within a few steps, no NaN weights saved or exported, valid metrics."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir, *FAST, "--learning_rate", "1e6", check=False)
    line = refused(result, "training diverged", "learning_rate")
    checkpoints = list_checkpoints(output_dir)  # those saved before it blew up, all finite
    for path in checkpoints:
        assert all(t.isfinite().all() for t in load_file(path / "model.safetensors").values()), path
    kept = f"the last checkpoint, {checkpoints[-1]}," if checkpoints else "no checkpoint was written"
    assert kept in line
    assert not (output_dir / "model").exists() and not (output_dir / "best_model").exists()
    metrics = output_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))


def test_divergence_after_a_checkpoint_keeps_it(copy_of: Path) -> None:
    """Weights that blow up after a resume (poisoned, checksums made to match): the run stops at the first
    logging step, and the checkpoint it resumed from, model/ and best_model/ stay as they were."""
    shutil.rmtree(copy_of / "model")
    (copy_of / "curves.png").unlink()  # drawn again, after the divergence too
    newest, older = list_checkpoints(copy_of)[::-1]
    shutil.rmtree(newest)
    weights = older / "model.safetensors"
    tensors = load_file(weights)
    save_file({name: t * 1e30 if t.is_floating_point() else t for name, t in tensors.items()}, weights)
    record = json.loads((older / LOOP_STATE_FILE).read_text())
    record["files"]["model.safetensors"] = {
        "bytes": weights.stat().st_size,
        CHECKSUM: file_xxh3(weights),
    }
    (older / LOOP_STATE_FILE).write_text(json.dumps({**record, "seal": seal(record)}))
    before = snapshot(copy_of)
    # No rollback (it would go back to that checkpoint and seal its skip in: test_rollback.py of digits).
    result = run_training(copy_of, *FAST, "--max_rollbacks", "0", check=False)
    refused(result, "training diverged", f"the last checkpoint, {older}")
    assert result.stdout.splitlines()[-1] == f"curves: {copy_of / 'curves.png'}"
    assert list_checkpoints(copy_of) == [older]
    # The run's history records the divergence, which no checkpoint saw.
    last = json.loads((copy_of / "history.json").read_text())["sessions"][-1]
    assert last["ending"].startswith(f"diverged at step {last['end_step']}: the train loss")
    # What the session writes at its start aside: config.yaml (with this copy's output_dir), the metrics,
    # the history and the tracker's files (TensorBoard's logs/; MLflow marks its run as running again in
    # mlflow.db).
    session = ("config.yaml", "metrics.jsonl", "history.json", "logs/", "mlflow.db", "wandb/", "curves.png")
    assert {k: v for k, v in snapshot(copy_of).items() if not k.startswith(session)} == {
        k: v for k, v in before.items() if not k.startswith(session)
    }


def test_bad_value_stops_before_anything_is_written(tmp_path: Path) -> None:
    """An out-of-range value (here --seed -5) is a one-line error before the folder exists; test_config.py
    checks the others (non-finite floats included) without starting train.py."""
    output_dir = tmp_path / "run"
    result = run_training(output_dir, *FAST, "--seed", "-5", check=False)
    refused(result, "--seed: seed=-5 is invalid: it must be between 0 and 2**32 - 1")
    assert not output_dir.exists()


def test_output_dir_that_is_a_file_is_named(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    output_dir.write_text("not a folder")
    result = run_training(output_dir, *FAST, check=False)
    refused(result, f"cannot write to output_dir {output_dir} (File exists)")
    assert output_dir.read_text() == "not a folder"


def test_relative_output_dir_is_relative_to_the_project(tmp_path: Path) -> None:
    """Started from another working directory, the same command writes to the same folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    relative = os.path.relpath(tmp_path / "run", PROJECT)
    command, env = training_command(Path(relative), *FAST)
    command[1:4] = [str(PROJECT / "train.py"), "--config", str(PROJECT / "configs" / "local.yaml")]
    result = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"output {tmp_path / 'run'}" in result.stdout
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert not any(elsewhere.iterdir())


def test_concurrent_starts_one_runs_the_other_is_refused_at_once(tmp_path: Path) -> None:
    """Two runs started together on one folder: one trains, the other stops at the lock with the holder's
    host and pid and writes nothing; the winner, stopped by SIGTERM, then continues alone."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN)
    start = {"cwd": PROJECT, "env": env, "stdout": PIPE, "stderr": PIPE, "text": True}
    runs = [subprocess.Popen(command, **start) for _ in range(2)]
    deadline = time.monotonic() + 300
    while all(run.poll() is None for run in runs):
        assert time.monotonic() < deadline, "neither run was refused"
        time.sleep(0.05)
    (loser,) = [run for run in runs if run.poll() is not None]
    (winner,) = [run for run in runs if run is not loser]
    winner.send_signal(signal.SIGTERM)
    _, loser_err = loser.communicate(timeout=60)
    _, winner_err = winner.communicate(timeout=300)
    assert loser.returncode == 1, loser_err[-3000:]
    line = loser_err.strip().splitlines()[-1]
    assert line.startswith(f"error: output_dir {output_dir} is in use by another run (host "), line
    assert f"pid {winner.pid}," in line
    assert winner.returncode in (0, EXIT_STOPPED), winner_err[-3000:]
    run_training(output_dir, *SIGNAL_RUN)  # the same command continues the winner's run
    train_steps = [row["step"] for row in read_metrics(output_dir) if "train/loss" in row]
    assert train_steps == sorted(set(train_steps)), "two runs' metrics interleaved"


def test_lock_of_a_killed_run_is_taken_over(tmp_path: Path) -> None:
    """kill -9 leaves the lock file naming a dead process: the next run says so, takes it over, finishes
    and leaves the lock free."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN)
    since = time.time()
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=DEVNULL, stderr=DEVNULL)
    wait_for_training(output_dir, process, since)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert json.loads((output_dir / LOCK_FILE).read_text())["pid"] == process.pid
    result = run_training(output_dir, *SIGNAL_RUN)
    assert f"was left by a run that is gone (host {socket.gethostname()}, pid {process.pid}," in result.stdout
    assert (output_dir / LOCK_FILE).read_text() == ""  # released at the end: free


def test_a_lock_of_another_machine_holds_while_its_heartbeat_is_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where locks are not shared between machines (Drive seen from two Colab sessions), a lock file naming
    another host stops a second run while its heartbeat is fresh, and is taken over once it is stale; the
    new holder's heartbeat renews the file, and release leaves it empty."""
    lock_file = tmp_path / LOCK_FILE
    lock_file.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "earlier"}))
    with pytest.raises(FolderInUse, match=r"was in use \d+ s ago by a run on elsewhere"):
        OutputLock(tmp_path).acquire()
    stale = time.time() - run_dir.STALE_AFTER_S - 1
    os.utime(lock_file, (stale, stale))
    monkeypatch.setattr(run_dir, "HEARTBEAT_S", 0.05)
    lock = OutputLock(tmp_path)
    (note,) = lock.acquire()
    assert "was left by a run that is gone (host elsewhere, pid 1, started earlier)" in note, note
    os.utime(lock_file, (stale, stale))
    deadline = time.monotonic() + 30
    while lock_file.stat().st_mtime < time.time() - 60:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.02)
    lock.release()
    assert lock_file.read_bytes() == b""


def test_stop_signal_to_the_whole_process_group_with_workers_still_checkpoints(tmp_path: Path) -> None:
    """SLURM signals every process of a job step, DataLoader workers included (as `kill -- -PGID` does):
    the workers leave the signal to the main process, which stops at a checkpoint (exit 75); the rerun
    ends bitwise equal to an uninterrupted run."""
    workers = ["--num_workers", "2"]
    reference = tmp_path / "reference"
    run_training(reference, *SIGNAL_RUN, *workers)
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN, *workers)
    since = time.time()
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    )
    wait_for_training(output_dir, process, since)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, err[-3000:]
    assert "killed by signal" not in err
    assert (out + err).count("received") == 1, err[-3000:]  # the main process's line, none from a worker
    run_training(output_dir, *SIGNAL_RUN, *workers)
    assert_same_run(output_dir, reference)


@pytest.mark.parametrize("files_written", [1, 3, 99])
def test_kill_inside_a_background_write_resumes_bitwise(
    finished: Path, tmp_path: Path, files_written: int
) -> None:
    """kill -9 while the persister's thread writes a checkpoint (checkpoint_mode background, the default),
    after `files_written` of its files (99: while it seals and publishes, or between saves): the newest
    published checkpoint verifies, and the same command ends bitwise equal to an uninterrupted run."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *FAST)
    env[PAUSE_ENV] = "0.4"  # before each file the thread writes: the kill lands inside the write
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=DEVNULL, stderr=PIPE, text=True)
    staging = checkpoint_root(output_dir) / f"{STAGING_PREFIX}step_00000004"
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        written = len(list(staging.iterdir())) if staging.is_dir() else 0
        published = (checkpoint_root(output_dir) / "step_00000004").is_dir()
        if written >= files_written or (files_written == 99 and published):
            break
        time.sleep(0.005)
    assert process.poll() is None, process.stderr.read()[-3000:] if process.stderr else ""
    process.kill()
    process.wait()
    kept = list_checkpoints(output_dir)
    assert kept and all(checkpoint_problem(path) is None for path in kept), kept
    run_training(output_dir, *FAST)
    assert_same_run(output_dir, finished)


def test_a_checkpoint_said_saved_is_published_and_in_the_history_when_killed_at_that_line(
    tmp_path: Path,
) -> None:
    """kill -9 the moment `checkpoint: step N saved to <dir>` is printed, its files written slowly in the
    background: the folder it names exists and verifies, and history.json claims no later step."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *FAST)
    env[PAUSE_ENV] = "0.3"  # the thread is still writing for seconds after the hand-over
    process = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=PIPE, stderr=DEVNULL, text=True)
    assert process.stdout is not None
    said = None
    for line in process.stdout:
        if said := re.match(r"checkpoint: step (\d+) saved to (\S+)$", line.strip()):
            process.kill()
            break
    process.wait()
    assert said, "no checkpoint was said to be saved"
    folder = Path(said.group(2))
    assert folder.is_dir() and checkpoint_problem(folder) is None, sorted(folder.parent.iterdir())
    sessions = json.loads((output_dir / "history.json").read_text())["sessions"]
    assert sessions[-1]["end_step"] <= int(said.group(1)), sessions[-1]


def test_sigterm_during_a_background_write_exits_75_with_the_newest_checkpoint_whole(
    finished: Path, tmp_path: Path
) -> None:
    """SIGTERM while the thread writes the step-2 checkpoint: the stop waits for that write, saves the step
    it stops at, exits 75; every checkpoint verifies, the newest is the stop's, and the rerun is exact."""
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *FAST)
    env[PAUSE_ENV] = "0.4"
    process = subprocess.Popen(
        command, cwd=PROJECT, env=env, stdout=PIPE, stderr=subprocess.STDOUT, text=True
    )
    staging = checkpoint_root(output_dir) / f"{STAGING_PREFIX}step_00000002"
    deadline = time.monotonic() + 300
    while process.poll() is None and not (staging.is_dir() and any(staging.iterdir())):
        assert time.monotonic() < deadline, "no background write began"
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_STOPPED, output[-3000:]
    kept = list_checkpoints(output_dir)
    assert all(checkpoint_problem(path) is None for path in kept), kept
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+)", output).group(1))
    assert int(kept[-1].name[5:]) == stopped_at and stopped_at >= 2, (kept, output[-2000:])
    run_training(output_dir, *FAST)
    assert_same_run(output_dir, finished)


def in_small_filesystem(
    tmp_path: Path, script: str, size: str | int, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `script` (bash) with a fresh tmpfs of `size` mounted at $DISK, in a private mount namespace."""
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    wrapped = f'mount -t tmpfs -o size={size} tmpfs "$DISK" && {script}'
    command = ["unshare", "--mount", "bash", "-c", wrapped]
    if os.geteuid() != 0:  # an unprivileged user may mount in a user namespace of its own, where allowed
        command[1:1] = ["--user", "--map-root-user"]
    env = {**os.environ, **(env or {}), "DISK": str(disk), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=900)


def test_disk_full_names_the_disk_and_keeps_the_last_checkpoint(finished: Path, tmp_path: Path) -> None:
    """A tmpfs too small for the run: the write that fails is named with the free space, the last complete
    checkpoint stays valid, and with space again the same command finishes the run exactly."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    probe = in_small_filesystem(tmp_path, 'touch "$DISK/probe"', "1m")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()[-300:]}")
    used = sum(path.stat().st_size for path in finished.rglob("*") if path.is_file())
    flags = " ".join(FAST)
    train = f'"{sys.executable}" train.py --config configs/local.yaml --output_dir "$DISK/run" {flags}'
    script = (
        f'{train} > "$OUT/first.out" 2> "$OUT/first.err"; echo $? > "$OUT/first.rc"; '
        'cp -r "$DISK/run" "$OUT/first"; '
        'mount -o remount,size=1g "$DISK" && '
        f'{train} > "$OUT/second.out" 2> "$OUT/second.err"; echo $? > "$OUT/second.rc"; '
        'cp -r "$DISK/run" "$OUT/run"'
    )
    out = tmp_path / "out"
    out.mkdir()
    result = in_small_filesystem(tmp_path, script, used * 6 // 10, {"OUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert "Traceback" not in first_err, first_err[-3000:]
    line = first_err.strip().splitlines()[-1]
    assert line.startswith("error: could not write ") and "the disk is full" in line, line
    assert "MiB free on the filesystem of" in line
    assert all(checkpoint_problem(path) is None for path in list_checkpoints(out / "first"))
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()[-3000:]
    assert_same_run(out / "run", finished)


def test_disk_full_before_the_start_names_the_output_folder_and_leaves_nothing(tmp_path: Path) -> None:
    """A disk with room for the lock file and no more: the one line names config.yaml in the output folder
    and that filesystem's free space, no file is left behind (an empty config.yaml would refuse every
    rerun), and with space again the same command runs."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    page = os.sysconf("SC_PAGE_SIZE")  # the lock file's one page fills it
    probe = in_small_filesystem(tmp_path, 'touch "$DISK/probe"', page)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()[-300:]}")
    flags = "--max_steps 2"
    train = f'"{sys.executable}" train.py --config configs/local.yaml --output_dir "$DISK/run" {flags}'
    script = (
        f'{train} > "$OUT/first.out" 2> "$OUT/first.err"; echo $? > "$OUT/first.rc"; '
        'ls -A "$DISK" > "$OUT/left.txt"; '
        'mount -o remount,size=1g "$DISK" && '
        f'{train} > "$OUT/second.out" 2> "$OUT/second.err"; echo $? > "$OUT/second.rc"'
    )
    out = tmp_path / "out"
    out.mkdir()
    result = in_small_filesystem(tmp_path, script, page, {"OUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert "Traceback" not in first_err, first_err[-3000:]
    line = first_err.strip().splitlines()[-1]
    disk = tmp_path / "disk"
    assert line.startswith(f"error: could not write {disk / 'run' / 'config.yaml'}: the disk is full ("), line
    assert f"MiB free on the filesystem of {disk}" in line, line
    assert (out / "left.txt").read_text() == ""  # not even the output folder
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()[-3000:]


def test_a_disk_that_fills_mid_run_is_one_line_whatever_the_tracker(tmp_path: Path) -> None:
    """The disk fills up while training writes (another program takes the rest of it after the first
    checkpoint): one line names the write that failed first, with no traceback, also where a tracker
    (mlflow's files) fails again on the same disk as the run is closed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    probe = in_small_filesystem(tmp_path, 'touch "$DISK/probe"', "1m")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()[-300:]}")
    flags = "--max_steps 100000 --log_every 2 --checkpoint_every 20"
    train = f'"{sys.executable}" train.py --config configs/local.yaml --output_dir "$DISK/run" {flags}'
    script = (
        f'{train} > "$OUT/run.out" 2> "$OUT/run.err" & '
        'until ls "$DISK/run/checkpoints" | grep -q "^step_"; do sleep 0.05; done; '
        'head -c 4G /dev/zero > "$DISK/filler" 2> /dev/null; wait $!; echo $? > "$OUT/run.rc"'
    )
    out = tmp_path / "out"
    out.mkdir()
    result = in_small_filesystem(tmp_path, script, "256m", {"OUT": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    err = (out / "run.err").read_text()
    assert (out / "run.rc").read_text().strip() == "1" and "Traceback" not in err, err[-5000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: could not write ") and "the disk is full" in line, line


def test_a_bfloat16_export_is_half_the_size_and_leaves_the_checkpoints_as_they_were(
    finished: Path, tmp_path: Path
) -> None:
    """export_dtype bfloat16: model/ and best_model/ hold the same weights rounded to bfloat16, in about half
    the bytes; the checkpoints' weights and optimizer state are byte for byte those of a float32 export."""
    if hasattr(task, "export"):
        pytest.skip("this task writes its own export format: checked here for the default model.safetensors")
    output_dir = tmp_path / "run"
    run_training(output_dir, *FAST, "--export_dtype", "bfloat16")
    for folder in ("model", "best_model"):
        ours, theirs = output_dir / folder / "model.safetensors", finished / folder / "model.safetensors"
        half, full = load_file(ours), load_file(theirs)
        assert half.keys() == full.keys()
        for name, tensor in full.items():
            expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(half[name], expected), name
        assert ours.stat().st_size / theirs.stat().st_size < 0.55
    for ours, theirs in zip(list_checkpoints(output_dir), list_checkpoints(finished), strict=True):
        for name in ("model.safetensors", "optimizer.bin"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (ours, name)


def test_a_metrics_log_shorter_than_its_checkpoint_is_repaired_with_one_warning(copy_of: Path) -> None:
    """metrics.jsonl cut mid-line below the length the newest checkpoint recorded (a copy cut short): the
    resume says so in one line, cuts it back to whole lines, and the log it ends with is all JSON, each
    step's values once, whatever the tracker (TensorBoard replays the log at the start)."""
    newest = list_checkpoints(copy_of)[-1]
    recorded = json.loads((newest / LOOP_STATE_FILE).read_text())["loop_state"]["metrics_bytes"]
    path = copy_of / "metrics.jsonl"
    text = path.read_bytes()[:recorded]
    cut = text.rfind(b"\n", 0, len(text) - 1) + 10  # inside the last line the checkpoint counted
    path.write_bytes(text[:cut])
    result = run_training(copy_of, *FAST, "--max_steps", "8")
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (warning,) = [line for line in result.stdout.splitlines() if line.startswith(f"WARNING: {path} held")]
    assert f"held {cut} of the {recorded} bytes its checkpoint of step 6 counted" in warning
    rows = read_metrics(copy_of)  # every line is JSON
    logged = [(row["step"], name) for row in rows for name in row if name != "step"]
    assert len(logged) == len(set(logged)), logged
    assert (8, "train/loss") in logged


def test_metrics_reach_the_disk_before_a_checkpoint_seals_their_length(tmp_path: Path) -> None:
    """Each checkpoint records the length of metrics.jsonl and seals it: the log is fsynced before the
    seal is written (else a power cut could leave the log shorter than its sealed length)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("reads the fsynced files' names from /proc")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "_fsync = os.fsync\n"
        "def fsync(fd):\n"
        "    with open(os.environ['FSYNC_LOG'], 'a') as log:\n"
        "        log.write(os.readlink(f'/proc/self/fd/{fd}') + '\\n')\n"
        "    _fsync(fd)\n"
        "os.fsync = fsync\n"
    )
    output_dir, log = tmp_path / "run", tmp_path / "fsync.log"
    command, env = training_command(output_dir, *FAST)
    env.update(FSYNC_LOG=str(log), PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]))
    result = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    synced = log.read_text().splitlines()
    seals = [index for index, name in enumerate(synced) if name.endswith(LOOP_STATE_FILE)]
    assert len(seals) == 3, synced  # steps 2, 4 and 6
    # One fsync of the log per checkpoint, each before that checkpoint's seal (in the background mode it
    # comes when the state is staged, which may be before the previous checkpoint's seal is written).
    for count, seal_at in enumerate(seals, start=1):
        logs = [name for name in synced[:seal_at] if name == str(output_dir / "metrics.jsonl")]
        assert len(logs) >= count, synced[:seal_at]


def test_a_config_write_cut_off_by_a_kill_does_not_block_the_rerun(tmp_path: Path) -> None:
    """kill -9 while config.yaml was first written: config.yaml is written to a temporary name and renamed
    when whole, so what such a kill leaves is that temporary file, half-written. The same command starts
    the run (it would refuse a folder holding an earlier run's files) and replaces it."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    cut_off = output_dir / f"{TEMPORARY_PREFIX}config.yaml"
    cut_off.write_text("seed: 4")
    result = run_training(output_dir, *FAST)
    assert f"starting fresh in {output_dir}" in result.stdout
    assert not cut_off.exists()
    assert "seed: " in (output_dir / "config.yaml").read_text()


def test_a_killed_loader_worker_is_one_line_the_checkpoint_untouched_and_the_rerun_continues(
    tmp_path: Path,
) -> None:
    """A DataLoader worker killed with SIGKILL (as the out-of-memory killer does), and those started after
    it: one line that says so and that the rerun continues, not PyTorch's traceback; exit 1; the newest
    checkpoint byte for byte what it was; the rerun resumes from it."""
    workers = ["--num_workers", "2"]
    output_dir = tmp_path / "run"
    command, env = training_command(output_dir, *SIGNAL_RUN, *workers)
    process = psutil.Popen(command, cwd=PROJECT, env=env, stdout=PIPE, stderr=PIPE, text=True)
    wait_for_checkpoint(output_dir, process)
    process.suspend()  # what it has saved stays as it is now
    newest = list_checkpoints(output_dir)[-1]
    saved = snapshot(newest)
    process.resume()
    while process.poll() is None:
        for worker in process.children():
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        time.sleep(0.02)
    out, err = process.communicate(timeout=120)
    # torch's reason: "is killed by signal: Killed", or "exited unexpectedly" (whichever it saw first)
    line = refused(subprocess.CompletedProcess(command, process.returncode, out, err), "DataLoader worker ")
    assert line.endswith("(out of memory?): rerun the same command to continue"), line
    assert snapshot(newest) == saved
    resumed = run_training(output_dir, *SIGNAL_RUN, *workers)
    assert f"resuming from {output_dir / 'checkpoints'}" in resumed.stdout, resumed.stdout[-2000:]
