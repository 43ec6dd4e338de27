"""Checkpoint mechanics in one process: rotation rules and precision changes across a resume."""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.checkpoints.checkpoint import (
    RETIRED_KEYS,
    LoopState,
    _rotate,
    checkpoint_problem,
    frozen_weights,
    list_checkpoints,
    load_checkpoint,
    read_loop_state,
    save_checkpoint,
    save_trained_weights_only,
    seal,
)
from {{ cookiecutter.package_name }}.utils.checkpoints.durable import write_atomically
from {{ cookiecutter.package_name }}.utils.checkpoints.persist import Persister
from {{ cookiecutter.package_name }}.utils.config import TrainConfig, save_config

from .conftest import last_eval, run_training


def fake_checkpoint(root: Path, step: int, valid: bool) -> Path:
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    if valid:
        state = {"loop_state": {"step": step}, "files": {}}
        (path / "loop_state.json").write_text(json.dumps({**state, "seal": seal(state)}))
    return path


def test_rotation_removes_only_readable_checkpoints_older_than_the_latest(tmp_path: Path) -> None:
    """keep=1: the one just written stays, and the one resumed from; an unreadable one is left for a person
    to look at, never deleted."""
    resumed_from = fake_checkpoint(tmp_path, 1, valid=True)
    fake_checkpoint(tmp_path, 2, valid=True)
    unreadable = fake_checkpoint(tmp_path, 3, valid=False)  # killed before its loop state was written
    latest = fake_checkpoint(tmp_path, 4, valid=True)
    config = TrainConfig(output_dir=str(tmp_path), keep_checkpoints=1, max_rollbacks=0)
    _rotate(config, protect=resumed_from, latest=latest)
    assert list_checkpoints(tmp_path) == [resumed_from, unreadable, latest]


def test_rotation_keeps_the_checkpoint_a_rollback_may_need(tmp_path: Path) -> None:
    """A loss logged after step 10 (log_every 5) rolls back to step 6, 8 or 10: keep=1 keeps those too, and
    lets each go once a newer one serves."""
    older = [fake_checkpoint(tmp_path, step, valid=True) for step in (2, 4, 6, 8)]
    latest = fake_checkpoint(tmp_path, 10, valid=True)
    config = TrainConfig(output_dir=str(tmp_path), keep_checkpoints=1, log_every=5)
    _rotate(config, protect=None, latest=latest)
    assert list_checkpoints(tmp_path) == [older[2], older[3], latest]
    newest = fake_checkpoint(tmp_path, 12, valid=True)
    _rotate(config, protect=None, latest=newest)
    assert list_checkpoints(tmp_path) == [older[3], latest, newest]


def test_a_loop_state_key_of_an_earlier_version_is_skipped(tmp_path: Path) -> None:
    """A checkpoint of an earlier version holds keys of dropped features (continue_on_new_data's record): it
    still reads and resumes; a key no version knew is refused."""
    path = fake_checkpoint(tmp_path, 2, valid=False)
    for key in (*RETIRED_KEYS, "field_of_a_newer_version"):
        state = {"loop_state": {"step": 2, key: []}, "files": {}}
        (path / "loop_state.json").write_text(json.dumps({**state, "seal": seal(state)}))
        if key in RETIRED_KEYS:
            assert checkpoint_problem(path) is None and read_loop_state(path).step == 2
    assert "written by another version" in checkpoint_problem(path)


def test_a_loop_state_without_a_seal_is_named_as_another_versions(tmp_path: Path) -> None:
    """The first version sealed nothing: its checkpoint is named as another version's, not as edited."""
    path = fake_checkpoint(tmp_path, 2, valid=False)
    (path / "loop_state.json").write_text(json.dumps({"loop_state": {"step": 2}, "files": {}}))
    assert checkpoint_problem(path) == (
        "loop_state.json was written by another version of this project (KeyError('seal'))"
    )


def test_rotation_keeps_everything_when_the_latest_is_unsound(tmp_path: Path) -> None:
    older = [fake_checkpoint(tmp_path, step, valid=True) for step in (1, 2)]
    latest = fake_checkpoint(tmp_path, 3, valid=True)
    (latest / "loop_state.json").write_text("{")  # damaged after its save
    _rotate(TrainConfig(output_dir=str(tmp_path), keep_checkpoints=1), protect=None, latest=latest)
    assert list_checkpoints(tmp_path) == [*older, latest]


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_fp16_resume_of_a_checkpoint_without_scaler_state(accelerator: Accelerator, tmp_path: Path) -> None:
    """A CPU or bf16 checkpoint has no scaler.pt; resuming it with an fp16 GradScaler must not fail."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    config = TrainConfig(output_dir=str(tmp_path))
    path = save_checkpoint(accelerator, config, LoopState(step=3, samples_seen=192))
    assert checkpoint_problem(path) is None and not (path / "scaler.pt").exists()

    # What an fp16 run on a GPU has: a GradScaler. This machine has no GPU, so it is set by hand.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    accelerator.scaler = scaler
    state = load_checkpoint(accelerator, path)
    assert (state.step, state.samples_seen) == (3, 192)
    assert accelerator.scaler is scaler and scaler.get_scale() == 1024.0  # fresh, not loaded

    # And the other way: an fp16 checkpoint (with scaler.pt) resumed without a scaler.
    fp16_path = save_checkpoint(accelerator, config, LoopState(step=4))
    assert (fp16_path / "scaler.pt").exists()
    accelerator.scaler = None
    assert load_checkpoint(accelerator, fp16_path).step == 4


def test_frozen_weights_stay_out_and_a_load_before_prepare_is_refused(
    accelerator: Accelerator, tmp_path: Path
) -> None:
    """A frozen layer is not saved and a load checks that the rest is all there; loading before prepare,
    which Accelerate would do silently and without effect, raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    assert frozen_weights(model)[0] and frozen_weights(torch.nn.Linear(4, 2)) == ("", "")
    fresh = Accelerator(cpu=True)
    with pytest.raises(RuntimeError, match=r"call accelerator\.prepare first"):
        load_checkpoint(fresh, tmp_path)
    save_trained_weights_only(accelerator)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, optimizer = accelerator.prepare(model, optimizer)
    path = save_checkpoint(accelerator, TrainConfig(output_dir=str(tmp_path)), LoopState(step=1))
    assert set(load_file(path / "model.safetensors")) == {"1.weight", "1.bias"}
    trained = model[1].weight.detach().clone()
    with torch.no_grad():
        model[1].weight.zero_()
    load_checkpoint(accelerator, path)
    assert torch.equal(model[1].weight, trained)
    model[0].requires_grad_(True)  # now the file lacks a weight the model trains: refused, not skipped
    with pytest.raises(RuntimeError, match=r"lacks trained weights of the model: 0\.bias, 0\.weight"):
        load_checkpoint(accelerator, path)


def test_a_flipped_byte_fails_the_checksum(accelerator: Accelerator, tmp_path: Path) -> None:
    """Checkpoints record an XXH3-128 checksum of every file: one byte changed in the weights is caught."""
    model = torch.nn.Linear(4, 2)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    path = save_checkpoint(accelerator, TrainConfig(output_dir=str(tmp_path)), LoopState(step=1))
    assert checkpoint_problem(path) is None
    weights = path / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 1
    weights.write_bytes(bytes(damaged))
    assert checkpoint_problem(path).startswith("model.safetensors does not match its checksum")


def test_background_saves_reuse_their_buffers_and_write_each_its_own_state(
    accelerator: Accelerator, tmp_path: Path
) -> None:
    """A background checkpoint copies the state into CPU buffers kept from one checkpoint to the next: the
    second reuses the first's memory, and each writes the state of its own step, not one left over."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    persister = Persister(accelerator, TrainConfig(output_dir=str(tmp_path)), published=lambda: None)
    memory = []
    for step in (1, 2):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
        path = persister.save(LoopState(step=step), None, {}, lambda path: None)
        memory.append({key: buffer.data_ptr() for key, buffer in persister.staging.buffers.items()})
        model.weight.data.add_(1.0)  # training goes on while the thread writes: not in this checkpoint
        persister.wait()
        assert checkpoint_problem(path) is None
        written = load_file(path / "model.safetensors")
        assert written.keys() == weights.keys() and all(torch.equal(written[k], weights[k]) for k in weights)
        assert torch.equal(torch.load(path / "optimizer.bin")["state"][0]["exp_avg"], moments)
    assert len(memory[0]) >= 4 and memory[1] == memory[0]  # weight, bias, and their moments: the same memory


@pytest.mark.slow
def test_bf16_checkpoint_resumes_in_fp32_and_back(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    args = ["--log_every", "5", "--checkpoint_every", "10"]
    first = run_training(output_dir, *args, "--mixed_precision", "bf16", "--max_steps", "10")
    assert "mixed precision bf16" in first.stdout
    second = run_training(output_dir, *args, "--mixed_precision", "no", "--max_steps", "20")
    assert "resuming from" in second.stdout and "mixed precision no" in second.stdout
    third = run_training(output_dir, *args, "--mixed_precision", "bf16", "--max_steps", "30")
    assert "resuming from" in third.stdout and "step_00000020" in third.stdout
    assert last_eval(output_dir)["step"] == 30
    assert math.isfinite(last_eval(output_dir)[task.Config().best_metric])


def test_a_write_that_fails_half_way_leaves_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.yaml (and every other file the run writes outside a checkpoint) is replaced in one rename: a
    write that fails before it (a full disk, here at the flush; a kill -9 alike) leaves the old file byte
    for byte, no temporary file, and an error that names the file, never an empty or half-written one."""
    path = tmp_path / "config.yaml"
    save_config(TrainConfig(seed=1), path)
    before = path.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as failed:
        save_config(TrainConfig(seed=2), path)
    assert failed.value.filename == str(path)  # the one-line error names it, not the working directory
    assert path.read_bytes() == before
    assert [entry.name for entry in tmp_path.iterdir()] == ["config.yaml"]
    monkeypatch.undo()
    write_atomically(path, "seed: 3\n")
    assert path.read_text() == "seed: 3\n"
