"""A run's history, with real runs of this project's task: every session is recorded inside the checkpoints
and in the run folder, every change between sessions is printed with its consequence at the resume, and
the common hop (Colab, one GPU -> Kaggle, two -> a laptop) keeps the per-device batch, so that a run
continued through the three platform configs ends bitwise equal to one that was never stopped."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.utils.config import load_config
from {{ cookiecutter.package_name }}.utils.run.history import HISTORY_FILE, declared_versions
from {{ cookiecutter.package_name }}.utils.training.resume_check import sample_hashes

from .conftest import (
    PROJECT,
    QUICK,
    SIGNAL_RUN,
    assert_same_run,
    read_metrics,
    run_training,
    sessions_of,
    start_training,
    wait_for_checkpoint,
)

# Off its platform, a platform config's paths are given on the command line.
OFF_PLATFORM = ["--mirror_dir", "", "--import_from", ""]


def hop(output_dir: Path, config: str, processes: int, *args: str) -> str:
    """One session of the run with a platform's config, on `processes` CPU processes; its output."""
    result = run_training(output_dir, *args, "--config", f"configs/{config}.yaml", processes=processes)
    return result.stdout


@pytest.mark.slow
def test_colab_kaggle_laptop_keep_the_split_and_end_bitwise_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/colab.yaml (1 process), kaggle.yaml (2) and local.yaml (1), one after the other on one run:
    the per-device batch stays 32, only the accumulation follows the processes, and the run ends with the
    weights and metrics of an uninterrupted one. The history names the hops and says they keep it exact.
    The first hop falls inside a logging interval: the train loss logged at its end is the mean over the
    interval's micro-batches on both sides of the hop (summed in another order: equal to rounding)."""
    # One CPU thread per process in every session: 1 and 2 processes would otherwise get 2 and 1 threads
    # each, and torch 2.3 splits a matrix product's sums by thread (.ci/lowest found it).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [*QUICK, "--mixed_precision", "no", *OFF_PLATFORM]
    reference = tmp_path / "reference"
    run_training(reference, *args)
    config, _ = load_config(args, PROJECT / "configs" / "local.yaml", task.Config)
    last = int(list_checkpoints(reference)[-1].name[5:])
    first, second = config.log_every + 2, 3 * config.log_every  # inside an interval, then at its end
    output_dir = tmp_path / "run"
    colab = hop(output_dir, "colab", 1, *args, "--max_steps", str(first))
    assert "per-device batch 32 x 1 processes x 2 accumulation" in colab
    kaggle = hop(output_dir, "kaggle", 2, *args, "--max_steps", str(second))
    assert "per-device batch 32 x 2 processes x 1 accumulation" in kaggle
    assert (
        "history: processes 1 -> 2, accumulation 2 -> 1 (per-device batch 32 kept): the same samples and "
        "random numbers (they follow the samples), the same two gradients added, so bitwise" in kaggle
    )
    assert "history: session 2 of run" in kaggle and f"(local, steps 0-{first}, max_steps reached)" in kaggle
    assert f"resume verified: step {first + 1} as session 1 recorded it, bit for bit" in kaggle
    laptop = hop(output_dir, "local", 1, *args)
    assert "history: processes 2 -> 1, accumulation 1 -> 2 (per-device batch 32 kept)" in laptop
    assert f"resume verified: step {second + 1} as session 2 recorded it, bit for bit" in laptop
    rows, expected = read_metrics(output_dir), read_metrics(reference)
    (hop_row,) = [
        i for i, row in enumerate(expected) if row["step"] == 2 * config.log_every and "train/loss" in row
    ]
    assert rows[hop_row].pop("train/loss") == pytest.approx(expected[hop_row].pop("train/loss"), rel=1e-6)
    (output_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (reference / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in expected))
    assert_same_run(output_dir, reference)  # the weights, bitwise, and every other logged number
    sessions = sessions_of(output_dir)
    assert [s["session"] for s in sessions] == [1, 2, 3]
    steps = [(s["start_step"], s["end_step"]) for s in sessions]
    assert steps == [(0, first), (first, second), (second, last)]
    split = [(s["processes"], s["per_device_batch"], s["accumulation"]) for s in sessions]
    assert split == [(1, 32, 2), (2, 32, 1), (1, 32, 2)]
    final = sessions_of(reference)[0]["ending"]  # done, or max_steps reached where the task's QUICK caps it
    assert [s["ending"] for s in sessions] == ["max_steps reached", "max_steps reached", final]
    # The same history is sealed into the last checkpoint, for the copies that carry it elsewhere.
    sealed = json.loads((list_checkpoints(output_dir)[-1] / HISTORY_FILE).read_text())["sessions"]
    assert [s["id"] for s in sealed] == [s["id"] for s in sessions]
    assert [s.get("resume") for s in sessions] == [None, "verified", "verified"]
    # The same versions in every session, whatever each launch imported: no version line at a hop.
    assert "may change the numbers" not in kaggle + laptop
    assert [s["versions"] for s in sessions] == 3 * [sessions[0]["versions"]]
    assert {"python", "torch", *INSTALLED} <= sessions[0]["versions"].keys()
    assert all(sessions[0]["versions"][name] == version for name, version in INSTALLED.items())


# What every project declares in pyproject.toml, as importlib.metadata finds it installed.
INSTALLED = {
    name: metadata.version(name) for name in ("accelerate", "safetensors", "pyyaml", "tqdm", "xxhash")
}


def test_the_versions_recorded_are_those_installed() -> None:
    versions = declared_versions()
    assert {name: versions.get(name) for name in INSTALLED} == INSTALLED
    assert versions["matplotlib"] == metadata.version("matplotlib")


@pytest.mark.slow
def test_a_killed_session_and_another_per_device_batch_are_named(tmp_path: Path) -> None:
    """A session killed (kill -9) after its first checkpoint has no recorded end; the next one, with half
    the per-device batch, says so, and says that the split changed the rounding."""
    output_dir = tmp_path / "run"
    config, _ = load_config(list(SIGNAL_RUN), PROJECT / "configs" / "local.yaml", task.Config)
    process = start_training(output_dir, *SIGNAL_RUN)
    wait_for_checkpoint(output_dir, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    saved = int(list_checkpoints(output_dir)[-1].name[5:])
    smaller = str(config.per_device_batch_size // 2)
    end = saved + config.log_every
    resumed = run_training(
        output_dir, *SIGNAL_RUN, "--per_device_batch_size", smaller, "--max_steps", str(end)
    )
    accumulation = config.global_batch_size // config.per_device_batch_size
    assert (
        f"history: session 1 has no recorded end: it was killed or crashed after its last checkpoint "
        f"(step {saved})" in resumed.stdout
    )
    assert (
        f"history: per-device batch {config.per_device_batch_size} -> {smaller}, accumulation "
        f"{accumulation} -> {2 * accumulation}: the same optimization (same global batch, same samples), "
        "but the float rounding now differs" in resumed.stdout
    )
    sessions = sessions_of(output_dir)
    assert [(s["start_step"], s["end_step"], s["ending"], s["per_device_batch"]) for s in sessions] == [
        (0, saved, "", config.per_device_batch_size),
        (saved, end, "max_steps reached", int(smaller)),
    ]


@pytest.mark.slow
def test_each_resume_checks_its_first_step_against_the_record_and_says_what_it_found(tmp_path: Path) -> None:
    """Sessions that end at max_steps record the step after their checkpoint without taking it; each resume
    compares its first step with that record: as it was (verified); a record whose loss, then batch, was
    altered (differs, saying whether the batch is the same); no record (said so); half the per-device
    batch (differs by float rounding: the batch is the same, the split is named, the difference measured);
    a rerun of the finished run (nothing to resume, said so).
    """
    output_dir = tmp_path / "run"
    args = [*QUICK, "--mixed_precision", "no"]
    config, _ = load_config(args, PROJECT / "configs" / "local.yaml", task.Config)
    half = str(config.per_device_batch_size // 2)

    def session(end: int, *more: str, alter: str = "") -> str:
        """Alter the record of the step after the newest checkpoint in the run folder's history (which the
        resume reads over the checkpoint's own copy), then run on to step `end`; what the resume said."""
        if alter:
            path = output_dir / HISTORY_FILE
            saved = json.loads(path.read_text())
            step = str(max(int(path.name[5:]) for path in list_checkpoints(output_dir)))
            (record,) = [s for s in saved["sessions"] if step in s.get("after_checkpoint", {})]
            if alter == "drop":
                del record["after_checkpoint"][step]
            else:  # the last hex digit of the loss or of the batch's hash
                value = record["after_checkpoint"][step][alter]
                record["after_checkpoint"][step][alter] = value[:-1] + ("1" if value[-1] != "1" else "2")
            path.write_text(json.dumps(saved))
        result = run_training(output_dir, *args, "--max_steps", str(end), *more)
        return "\n".join(
            line for line in result.stdout.splitlines() if line.startswith(("resume ", "finished"))
        )

    session(4)
    assert session(6) == "resume verified: step 5 as session 1 recorded it, bit for bit"
    loss = session(8, alter="loss")
    assert loss.startswith("resume differs at step 7: loss ")
    assert "(the batch is the same): nothing the history names changed" in loss
    assert "measured: relative difference " in loss and " in the gradient norm" in loss
    batch = session(10, alter="batch")
    assert batch.startswith("resume differs at step 9: loss ") and "(the batch differs)" in batch
    assert session(12, alter="drop").startswith("resume not verified: nothing was recorded of step 11 (")
    split = session(14, "--per_device_batch_size", half)
    assert split.startswith("resume differs at step 13: loss "), split
    assert f"(the batch is the same): per-device batch {config.per_device_batch_size} -> {half}" in split
    assert session(14) == "finished at step 14: nothing to resume"  # a rerun: says why no resume line comes
    assert [s.get("resume") for s in sessions_of(output_dir)] == [
        None,
        "verified",
        "differs",
        "differs",
        "not recorded",
        "differs",
        None,
    ]


@pytest.mark.slow
def test_a_version_change_is_measured_and_an_unreadable_history_is_set_aside(tmp_path: Path) -> None:
    """Another version of a dependency may change the numbers: the resume line measures whether it did.
    A run folder's history.json with a field of the wrong type is one line, set aside as
    history.json.unreadable; the run goes on with the checkpoint's sessions, its record naming the loss."""
    output_dir, path = tmp_path / "run", tmp_path / "run" / HISTORY_FILE
    args = [*QUICK, "--mixed_precision", "no"]

    def alter(key: str, value: object) -> str:
        saved = json.loads(path.read_text())
        saved["sessions"][-1][key] = value
        path.write_text(json.dumps(saved))
        return json.dumps(saved)

    run_training(output_dir, *args, "--max_steps", "4")
    torch_now = sessions_of(output_dir)[0]["versions"]["torch"]
    alter("versions", {**sessions_of(output_dir)[0]["versions"], "torch": "2.3.1"})
    changed = run_training(output_dir, *args, "--max_steps", "6").stdout
    assert f"history: torch 2.3.1 -> {torch_now}: it may change the numbers: the resume line" in changed
    assert "resume verified: step 5 as session 1 recorded it, bit for bit" in changed
    broken = alter("end_step", "x")
    resumed = run_training(output_dir, *args, "--max_steps", "8")
    line = (
        f"history: {path} cannot be read (TypeError: a session's end_step is missing or wrong; kept aside as "
        "history.json.unreadable): this history lacks the sessions only it held"
    )
    assert line in resumed.stdout.splitlines() and "Traceback" not in resumed.stderr, resumed.stdout
    assert "resume verified: step 7 as session 2 recorded it, bit for bit" in resumed.stdout
    assert (output_dir / f"{HISTORY_FILE}.unreadable").read_text() == broken
    sessions = sessions_of(output_dir)
    assert [(s["start_step"], s["end_step"]) for s in sessions] == [(0, 4), (4, 6), (6, 8)]
    assert sessions[-1]["unreadable"] == line.removeprefix("history: ")

    # A record of an older version (a field missing) and one of a newer version (a field more): both read,
    # and written back with the newer one's field.
    saved = json.loads(path.read_text())
    del saved["sessions"][0]["compile"]
    saved["sessions"][-1]["gpu_memory"] = "80 GiB"
    path.write_text(json.dumps(saved))
    (output_dir / f"{HISTORY_FILE}.unreadable").unlink()
    later = run_training(output_dir, *args, "--max_steps", "10").stdout
    assert not (output_dir / f"{HISTORY_FILE}.unreadable").exists(), later
    sessions = sessions_of(output_dir)
    assert [(s["start_step"], s["end_step"]) for s in sessions] == [(0, 4), (4, 6), (6, 8), (8, 10)]
    assert sessions[2]["gpu_memory"] == "80 GiB" and sessions[0]["compile"] is False


@pytest.mark.slow
def test_an_immutable_history_is_one_warning_and_the_run_goes_on(tmp_path: Path) -> None:
    """history.json that cannot be replaced (chattr +i, as a read-only mount refuses it too): one warning
    line naming it, and the run goes on; its checkpoints keep the history."""
    output_dir, path = tmp_path / "run", tmp_path / "run" / HISTORY_FILE
    args = [*QUICK, "--mixed_precision", "no"]
    run_training(output_dir, *args, "--max_steps", "4")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", path]).returncode != 0:
        pytest.skip("chattr +i needs root and a file system that has it (ext4, xfs)")
    try:
        result = run_training(output_dir, *args, "--max_steps", "6")
    finally:
        subprocess.run(["chattr", "-i", path], check=True)
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == [
        f"WARNING: {path} cannot be replaced (Operation not permitted): make it writable (chattr -i)"
    ]
    assert "Traceback" not in result.stderr
    sealed = json.loads((list_checkpoints(output_dir)[-1] / HISTORY_FILE).read_text())["sessions"]
    assert [(s["start_step"], s["end_step"]) for s in sealed] == [(0, 4), (4, 6)]


def test_a_sample_is_hashed_without_its_padding() -> None:
    """The resume's record names a sample by its content: padded to a longer batch (1 process cuts its
    micro-batches from 64 samples, 2 processes from 32 each), it is the same sample; a changed one is not."""
    short = {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 2, dtype=torch.int)}
    padded = {key: torch.nn.functional.pad(value, (0, 3)) for key, value in short.items()}
    changed = {**short, "input_ids": torch.tensor([[5, 6], [7, 9]])}
    assert sample_hashes(padded) == sample_hashes(short)
    assert sample_hashes(changed)[0] == sample_hashes(short)[0]
    assert sample_hashes(changed)[1] != sample_hashes(short)[1]


@pytest.mark.slow
def test_after_a_kill_9_with_nothing_changed_the_history_says_nothing_changed(tmp_path: Path) -> None:
    """A session killed (kill -9) has no clean end: one line says so, and that is not a change."""
    output_dir = tmp_path / "run"
    process = start_training(output_dir, *SIGNAL_RUN)
    wait_for_checkpoint(output_dir, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    saved = int(list_checkpoints(output_dir)[-1].name[5:])
    resumed = run_training(output_dir, *SIGNAL_RUN, "--max_steps", str(saved + 1)).stdout
    assert f"; nothing changed since session 1 (local, steps 0-{saved}, no clean end)" in resumed, resumed
    assert "history: session 1 has no recorded end: it was killed or crashed after its last" in resumed


@pytest.mark.slow
def test_one_then_two_processes_with_four_micro_batches_a_step_say_what_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-device batch 16 of a global 64: 1 process adds its 4 micro-batches' gradients in turn, 2 add 2
    each and then the two sums, so the last bits may differ. The history says so, not "bitwise"; the resume
    line names what it compared (session 1's record of the step), and whatever it measured."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread per process on both sides
    output_dir, args = tmp_path / "run", [*QUICK, "--mixed_precision", "no", "--per_device_batch_size", "16"]
    config, _ = load_config(args, PROJECT / "configs" / "local.yaml", task.Config)
    assert config.global_batch_size == 64
    run_training(output_dir, *args, "--max_steps", "4")
    resumed = run_training(output_dir, *args, "--max_steps", "6", processes=2).stdout
    change = "processes 1 -> 2, accumulation 4 -> 2 (per-device batch 16 kept)"
    assert (
        f"history: {change}: the same samples and random numbers (they follow the samples), the 4 "
        "micro-batches' gradients added in another grouping (each process's, then across processes), which "
        "may round otherwise: the resume line measures whether it did"
    ) in resumed.splitlines()
    assert "bitwise" not in "".join(line for line in resumed.splitlines() if line.startswith("history: "))
    (line,) = [line for line in resumed.splitlines() if line.startswith("resume ")]
    verified = "resume verified: step 5 as session 1 recorded it, bit for bit"
    assert line == verified or (line.startswith("resume differs at step 5: loss ") and change in line), line
