"""The disk a run will need, checked before step 1 against the free space of output_dir (and mirror_dir).

A run keeps `keep_checkpoints` checkpoints and writes the next one beside them before rotation removes the
oldest (one more at the peak), plus model/ and best_model/ and the staging folder of an export that
replaces one of them. A checkpoint holds the trained weights and AdamW's two moments (3x the trained
parameters' bytes), the buffers, and small files; an export holds every weight, in export_dtype. What the
run already holds there (its checkpoints and exports, on a resume) is counted as space it will reuse.
When that cannot fit, the run stops with one line that gives the numbers and what to change, before it
writes anything but its lock. The staged copy of checkpoint_mode background is in CPU memory, not on disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from .checkpoint import frozen_names
from .config import TrainConfig
from .run_dir import RunError

# Per checkpoint: the RNG files, loop_state.json, meta.json, config.yaml, history.json, the filesystem's
# rounding of each file to its blocks. Per run: metrics.jsonl, the tracker's logs.
CHECKPOINT_SLACK = 64 * 1024
RUN_SLACK = 512 * 1024


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """Estimated bytes of one checkpoint: trained weights and AdamW's two moments, buffers, small files."""
    frozen = frozen_names(model)
    trained = sum(
        param.numel() * param.element_size()
        for name, param in model.named_parameters()
        if name not in frozen and param.requires_grad
    )
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    return 3 * trained + buffers + CHECKPOINT_SLACK


def export_bytes(model: torch.nn.Module, export_dtype: str) -> int:
    """Estimated bytes of one export (model/ or best_model/): every weight, in export_dtype if set."""
    cast = getattr(torch, export_dtype).itemsize if export_dtype != "auto" else 0  # auto: as trained
    total = CHECKPOINT_SLACK
    for tensor in [*model.parameters(), *model.buffers()]:
        total += tensor.numel() * (cast if cast and tensor.is_floating_point() else tensor.element_size())
    return total


def disk_problem(model: torch.nn.Module, config: TrainConfig) -> str | None:
    """One line if what the run will keep does not fit in the free space of output_dir (and of a local
    mirror_dir, counted together when both are on one filesystem); None if it fits."""
    checkpoint, export = checkpoint_bytes(model), export_bytes(model, config.export_dtype)
    keep = config.keep_checkpoints
    need_here = (keep + 1) * checkpoint + 3 * export + RUN_SLACK
    places = [(f"output_dir {config.output_dir}", Path(config.output_dir))]
    if config.mirror_dir and "://" not in config.mirror_dir:  # a URL's store has no disk of ours
        places.append((f"mirror_dir {config.mirror_dir}", Path(config.mirror_dir)))
    disks: dict[int, tuple[str, Path, int]] = {}  # device -> (what is on it, a folder on it, bytes needed)
    for label, folder in places:
        existing, need = _existing(folder), need_here - _held(folder)
        device = os.stat(existing).st_dev
        if device in disks:  # both on one disk: both must fit
            other, _, other_need = disks[device]
            label, need = f"{other} and {label} (one disk)", need + other_need
        disks[device] = (label, existing, need)
    for label, folder, need in disks.values():
        free = shutil.disk_usage(folder).free
        if need > free:
            return (
                f"{label} has {_mb(free)} free, and this run will keep about {_mb(need)} there "
                f"({keep} checkpoints of {_mb(checkpoint)} + 1 while the next is written, model/ and "
                f"best_model/ of {_mb(export)} each + 1 being replaced): lower keep_checkpoints "
                f"(now {keep}), "
                "train fewer weights (a LoRA adapter), set export_dtype to bfloat16, or free some space "
                "(check_disk_space false starts anyway)"
            )
    return None


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a new output_dir is made later)."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _held(folder: Path) -> int:
    """Bytes the run already holds in `folder` (checkpoints, exports): they are replaced, not added."""
    held = 0
    for name in ("checkpoints", "model", "best_model"):
        if (folder / name).is_dir():
            held += sum(path.stat().st_size for path in (folder / name).rglob("*") if path.is_file())
    return held


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size < 2**30 else f"{size / 2**30:.2f} GiB"


def check_disk_space(accelerator: Accelerator, config: TrainConfig, model: torch.nn.Module) -> None:
    """Raise on every process the main process's one line if the run would not fit on its disk."""
    outcome: list[str | None] = [None]
    if accelerator.is_main_process and config.check_disk_space:
        outcome = [disk_problem(model, config)]
    outcome = broadcast_object_list(outcome)
    if outcome[0]:
        raise RunError(outcome[0])
