"""Checkpoints: Accelerate's `save_state` plus the loop's own position, published atomically.

Layout of `<output_dir>/checkpoints/step_<N>/`: what `save_state` writes (model, optimizer,
scheduler, grad scaler, one RNG file per process), `config.yaml`, and `loop_state.json`, written
last. A checkpoint is complete exactly when it sits under its final name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator

from .config import TrainConfig, save_config

LOOP_STATE_FILE = "loop_state.json"


@dataclass
class LoopState:
    """Where the loop is. `save_state` does not record any of this."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    # Counted over all processes together, so the position in the data survives a change of world size.
    epoch_samples: int = 0
    samples_seen: int = 0


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Published checkpoints, oldest first (temporary directories are not listed)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [path for path in root.glob("step_*") if path.is_dir() and path.name[5:].isdigit()]
    return sorted(found, key=lambda path: int(path.name[5:]))


def save_checkpoint(accelerator: Accelerator, config: TrainConfig, state: LoopState) -> Path:
    """Save on every process (each one writes its own RNG state), then publish by renaming on the main one."""
    root = checkpoint_root(config.output_dir)
    final = root / f"step_{state.step:08d}"
    staging = root / f".incomplete_step_{state.step:08d}"
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_config(config, staging / "config.yaml")
        _write_durably(staging / LOOP_STATE_FILE, json.dumps(dataclasses.asdict(state), indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
        _rotate(root, keep=config.keep_checkpoints)
    accelerator.wait_for_everyone()
    return final


def _rotate(root: Path, keep: int) -> None:
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
