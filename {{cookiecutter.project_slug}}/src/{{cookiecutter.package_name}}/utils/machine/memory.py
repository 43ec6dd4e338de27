"""`auto_batch_size: true`: the largest per-device batch that fits; the global batch stays (accumulation)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from ... import task
from ..config import ConfigError, TrainConfig, gradient_accumulation_steps
from ..run.history import HISTORY_FILE, session_record
from ..run.run_dir import RunError
from ..run.task_check import TaskModel, kept_random_state


def fit_batch_size(
    accelerator: Accelerator, config: TrainConfig, model: torch.nn.Module, samples: Any, resumed: Path | None
) -> None:
    """`resumed`'s if it ran on this device and layout; else the largest that fits on every process."""
    if not config.auto_batch_size:
        return
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError("auto_batch_size tries the whole model on one device: set per_device_batch_size")
    last: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):  # None: a fresh start
        last = json.loads((resumed / HISTORY_FILE).read_text(encoding="utf-8"))["sessions"][-1]
    now = session_record(accelerator, config, 0)  # what this session is, as the history records it
    if all(last.get(key) == now[key] for key in ("device", "processes")):
        size = last["per_device_batch"]
        outcome = f"kept from session {last['session']}, on this device and number of processes"
    else:
        model = accelerator.unwrap_model(model).train()
        share = config.global_batch_size // accelerator.num_processes
        sizes = [size for size in range(config.per_device_batch_size, 0, -1) if share % size == 0]
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}  # BatchNorm's statistics
        with kept_random_state([] if accelerator.device.type == "cpu" else [accelerator.device]):
            fitted = next((size for size in sizes if batch_fits(accelerator, model, samples, size)), 0)
        model.load_state_dict(buffers, strict=False)
        size = int(accelerator.gather(torch.tensor([fitted], device=accelerator.device)).min())
        if size == 0:
            raise RunError("auto_batch_size: a per-device batch of 1 runs out of memory: use a smaller model")
        failed = ", ".join(str(larger) for larger in sizes if larger > size)
        outcome = f"{failed} ran out of memory" if failed else "it fits"
    config.per_device_batch_size = size
    accumulation = gradient_accumulation_steps(config, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = accumulation
    accelerator.print(
        f"auto_batch_size: per-device batch {size} x {accumulation} accumulation = global batch "
        f"{config.global_batch_size} ({outcome})"
    )


def batch_fits(accelerator: Accelerator, model: torch.nn.Module, train_set: Any, size: int) -> bool:
    """Whether a forward and backward of `size` samples fit, with room for AdamW's moments."""
    room = [torch.empty_like(param) for param in model.parameters() if param.requires_grad for _ in range(2)]
    try:
        batch = send_to_device(task.collate([train_set[i] for i in range(size)]), accelerator.device)
        with accelerator.autocast():
            task.loss(TaskModel(model, model, training=True), batch).backward()
        return True
    except Exception as error:
        if not should_reduce_batch_size(error):
            raise
        return False
    finally:
        del room
        model.zero_grad(set_to_none=True)
        clear_device_cache(garbage_collection=True)
