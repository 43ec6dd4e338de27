"""Checkpoints that survive kills: Accelerate's `save_state` plus the loop's position, published atomically.

Layout of `<output_dir>/checkpoints/step_<N>/`: what `save_state` writes (model, optimizer, scheduler,
grad scaler, sampler, one RNG file per process), `config.yaml`, `meta.json` (platform, versions, time)
and `loop_state.json`, written last, which also lists the size of every other file. Everything is
written into a hidden staging folder that is renamed to `step_<N>` once complete, so a `step_<N>`
folder is always whole; the size list catches files damaged afterwards.

List the checkpoints of a run:  python -m {{ cookiecutter.package_name }}.utils.checkpoint <output_dir>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import accelerate
import torch
import yaml
from accelerate import Accelerator

from .config import ConfigError, TrainConfig, run_defining_fields, save_config
from .hardware import detect_platform

LOOP_STATE_FILE = "loop_state.json"
META_FILE = "meta.json"
STAGING_PREFIX = ".incomplete_"


@dataclass
class LoopState:
    """Where the loop is: what `save_state` does not record."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    # Counted over all processes together, so the position in the data survives a change of world size.
    epoch_samples: int = 0
    samples_seen: int = 0
    # The train loss summed since the last log, one entry per process, so that the next logged
    # loss is the same as in an uninterrupted run.
    loss_sums: list[float] = field(default_factory=list)
    loss_batches: int = 0
    # Size of metrics.jsonl at this step: a resumed run cuts off what was logged after it.
    metrics_bytes: int = 0
    last_eval_step: int = -1
    # Best value of config.best_metric so far, and evaluations since: best_model/ and early stopping.
    best_value: float | None = None
    best_step: int = -1
    evals_since_best: int = 0
    stopped_early: bool = False  # a rerun of an early-stopped run only exports
    # The experiment tracker's run, which a resumed run continues ("" before the first one).
    tracker_run_id: str = ""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Published checkpoints, oldest first, valid or not (staging folders are not listed)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [path for path in root.glob("step_*") if path.is_dir() and path.name[5:].isdigit()]
    return sorted(found, key=lambda path: int(path.name[5:]))


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, or None if it is complete and undamaged."""
    try:
        record = json.loads((path / LOOP_STATE_FILE).read_text())
        LoopState(**record["loop_state"])
        sizes: dict[str, int] = record["file_sizes"]
    except FileNotFoundError:
        return f"no {LOOP_STATE_FILE}: the save did not finish"
    except (ValueError, KeyError, TypeError) as error:
        return f"{LOOP_STATE_FILE} is damaged ({error})"
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_loop_state(path: Path) -> LoopState:
    return LoopState(**json.loads((path / LOOP_STATE_FILE).read_text())["loop_state"])


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


def save_checkpoint(
    accelerator: Accelerator, config: TrainConfig, state: LoopState, protect: Path | None = None
) -> Path:
    """Save on every process (each writes its own RNG state), then publish by renaming on the main one.

    All processes must call this at the same step. `protect` (the checkpoint the run resumed from)
    is never removed by rotation.
    """
    root = checkpoint_root(config.output_dir)
    final = root / f"step_{state.step:08d}"
    staging = root / f"{STAGING_PREFIX}{final.name}"
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_config(config, staging / "config.yaml")
        _write_durably(staging / META_FILE, json.dumps(_meta(accelerator), indent=2))
        sizes = {path.name: path.stat().st_size for path in sorted(staging.iterdir()) if path.is_file()}
        for name in sizes:  # the loop state is the seal: the files it vouches for must be on disk first
            _fsync(staging / name)
        record = {"loop_state": dataclasses.asdict(state), "file_sizes": sizes}
        _write_durably(staging / LOOP_STATE_FILE, json.dumps(record, indent=2))
        _fsync(staging)
        if final.exists():  # a run that resumed from an older checkpoint saves this step again
            _remove(final)
        os.replace(staging, final)
        _fsync(root)
        _rotate(config.output_dir, keep=config.keep_checkpoints, protect=protect)
    accelerator.wait_for_everyone()
    return final


def export_model(
    accelerator: Accelerator, model: torch.nn.Module, config: TrainConfig, folder: Path, info: dict[str, Any]
) -> None:
    """Write plain safetensors weights, the config that rebuilds the model and `info` to `folder`.

    All processes must call it (a sharded model is gathered first). The new export is staged and
    swapped in by renames, so `folder` never holds a mix of two exports.
    """
    staging = folder.with_name(f"{STAGING_PREFIX}{folder.name}")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_model(model, staging)
    # Every process looks into the staging folder inside save_model: none may still be there when the
    # main process renames it (rank 1 of 2 CPU processes once failed with FileNotFoundError).
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_config(config, staging / "config.yaml")
        (staging / "export.json").write_text(json.dumps(info, indent=2))
        for path in staging.iterdir():
            _fsync(path)
        if folder.exists():
            _remove(folder)
        os.replace(staging, folder)
        _fsync(folder.parent)
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, config: TrainConfig) -> tuple[LoopState, Path | None]:
    """Load the checkpoint `config.resume` asks for; return the loop state and where it came from.

    `auto` tries the newest checkpoint in output_dir first and falls back to older ones when a
    checkpoint is damaged, with a warning naming it; all processes agree on which one loaded.
    """
    if config.resume == "never":
        if list_checkpoints(config.output_dir):
            raise ConfigError(
                f"resume=never, but {checkpoint_root(config.output_dir)} holds checkpoints of an earlier "
                "run: choose a new output_dir, or delete that folder to start over"
            )
        accelerator.print("resume: never, starting fresh")
        return LoopState(), None
    if config.resume != "auto":
        candidates = [Path(config.resume)]
        if problem := checkpoint_problem(candidates[0]):
            raise ConfigError(f"resume={config.resume}: cannot resume from it: {problem}")
    else:
        candidates = []
        for path in reversed(list_checkpoints(config.output_dir)):
            problem = checkpoint_problem(path)
            if problem is None:
                candidates.append(path)
            else:
                accelerator.print(f"WARNING: skipping checkpoint {path}: {problem}")
    for path in candidates:
        if config.resume == "auto" and (changed := _changed_fields(path, config)):
            # Refuse before anything is overwritten: two different runs must not share a folder.
            raise ConfigError(
                f"{config.output_dir} holds a run with other settings ({changed}): rerun with the same "
                "settings to continue it, or choose a new output_dir for this one"
            )
        problem = None
        try:
            state = load_checkpoint(accelerator, path)
        except Exception as error:  # damaged in a way the size check cannot see
            problem = f"loading failed: {error!r}"
        # Every process must leave with the same checkpoint loaded.
        failed = accelerator.reduce(torch.tensor(int(problem is not None), device=accelerator.device), "sum")
        if failed.item() == 0:
            saved_world = read_meta(path).get("world_size", accelerator.num_processes)
            accelerator.print(
                f"resuming from {path} (step {state.step}, epoch {state.epoch}, {state.samples_seen} samples)"
            )
            if saved_world != accelerator.num_processes:
                accelerator.print(
                    f"note: saved by {saved_world} process(es), resumed by {accelerator.num_processes}: "
                    "weights, optimizer, schedule and data position carry over; the random streams of "
                    "processes that did not exist before start from the seed, so the run is not bit-exact"
                )
            return state, path
        problem = problem or "loading failed on another process"
        if config.resume != "auto":
            raise ConfigError(f"resume={config.resume}: cannot resume from it: {problem}")
        accelerator.print(f"WARNING: skipping checkpoint {path}: {problem}")
    accelerator.print(f"no usable checkpoint in {checkpoint_root(config.output_dir)}: starting fresh")
    return LoopState(), None


def _changed_fields(path: Path, config: TrainConfig) -> str:
    saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    changes = [
        f"{name} {saved.get(name)!r} -> {getattr(config, name)!r}"
        for name in run_defining_fields(config)
        if saved.get(name) != getattr(config, name)
    ]
    return ", ".join(changes)


def load_checkpoint(accelerator: Accelerator, path: Path) -> LoopState:
    """Restore model, optimizer, scheduler, RNG and sampler from `path` on every process."""
    scaler = accelerator.scaler
    if scaler is not None and not (path / "scaler.pt").exists():
        # Saved without fp16 (CPU or bf16): keep the fresh scaler instead of failing to load one.
        accelerator.scaler = None
    try:
        accelerator.load_state(str(path))
    finally:
        accelerator.scaler = scaler
    # Accelerate counts micro-batches for accumulation; checkpoints sit on optimizer-step boundaries,
    # so the count restarts at a window start (also when a new world size changed the accumulation).
    accelerator.step = 0
    return read_loop_state(path)


def _meta(accelerator: Accelerator) -> dict[str, Any]:
    return {
        "platform": detect_platform(),
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "device": str(accelerator.device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
        },
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _rotate(output_dir: str | Path, keep: int, protect: Path | None) -> None:
    """Keep the newest `keep` valid checkpoints (and `protect`); remove the rest and stale staging folders."""
    root = checkpoint_root(output_dir)
    valid = [path for path in list_checkpoints(output_dir) if checkpoint_problem(path) is None]
    kept = set(valid[-keep:])
    if protect is not None:
        kept.add(protect)
    for path in list_checkpoints(output_dir):
        if path not in kept:
            _remove(path)
    for staging in root.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(staging)


def _remove(path: Path) -> None:
    # Renamed out of sight first: a kill during the deletion must not leave a half-deleted step_<N>.
    doomed = path.with_name(f"{STAGING_PREFIX}removed_{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="List the checkpoints of a run, newest last.")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir")
    args = parser.parse_args(argv)
    paths = list_checkpoints(args.output_dir)
    if not paths:
        print(f"no checkpoints under {checkpoint_root(args.output_dir)}")
        return
    header = ("checkpoint", "status", "epoch", "samples", "world", "precision", "platform", "saved")
    print("{:<16} {:<8} {:>5} {:>9} {:>5} {:<9} {:<9} {}".format(*header))
    for path in paths:
        problem = checkpoint_problem(path)
        state = read_loop_state(path) if problem is None else None
        meta = read_meta(path)
        print(
            f"{path.name:<16} {'valid' if problem is None else 'INVALID':<8} "
            f"{state.epoch if state else '-':>5} {state.samples_seen if state else '-':>9} "
            f"{meta.get('world_size', '-'):>5} {meta.get('mixed_precision', '-'):<9} "
            f"{meta.get('platform', '-'):<9} {meta.get('saved_at', '-')}"
        )
        if problem:
            print(f"{'':<16} {problem}")


if __name__ == "__main__":
    main()
