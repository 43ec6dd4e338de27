"""`auto_batch_size: true`: the largest per-device batch that trains without running out of memory; the global
batch, and so the optimization, stay (more accumulation)."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from .. import task
from .config import ConfigError, TrainConfig, gradient_accumulation_steps
from .history import HISTORY_FILE, device_name
from .run_dir import RunError
from .task_check import TaskModel


def fit_batch_size(
    accelerator: Accelerator, config: TrainConfig, model: torch.nn.Module, samples: Any, resumed: Path | None
) -> None:
    """The per-device batch of the session that wrote checkpoint `resumed` if it ran on this device and as
    many processes; else the largest size, from per_device_batch_size down through those that divide a
    process's share of the global batch, whose training step on `samples` fits the unwrapped model on every
    process. The tries leave no random state, buffers or gradients."""
    if not config.auto_batch_size:
        return
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError("auto_batch_size tries the whole model on one device: set per_device_batch_size")
    last: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):  # None: a fresh start
        last = json.loads((resumed / HISTORY_FILE).read_text(encoding="utf-8"))["sessions"][-1]
    here = {"device": device_name(accelerator.device), "processes": accelerator.num_processes}
    if all(last.get(key) == value for key, value in here.items()):
        size = last["per_device_batch"]
        outcome = f"kept from session {last['session']}, on this device and number of processes"
    else:
        model = accelerator.unwrap_model(model).train()
        share = config.global_batch_size // accelerator.num_processes
        sizes = [size for size in range(config.per_device_batch_size, 0, -1) if share % size == 0]
        buffers = [buffer.clone() for buffer in model.buffers()]  # BatchNorm's statistics
        host_generators = np.random.get_state(), random.getstate()  # a task's items or loss may draw on them
        with torch.random.fork_rng(devices=[] if accelerator.device.type == "cpu" else [accelerator.device]):
            fitted = next((size for size in sizes if fits(accelerator, model, samples, size)), 0)
        np.random.set_state(host_generators[0])
        random.setstate(host_generators[1])
        with torch.no_grad():
            for buffer, kept in zip(model.buffers(), buffers, strict=True):
                buffer.copy_(kept)
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


def fits(accelerator: Accelerator, model: torch.nn.Module, train_set: Any, size: int) -> bool:
    """Whether a forward and backward of `size` samples fit, with room held for what the first optimizer
    step allocates (AdamW's two moments; DDP's gradient buckets are there). Gradients are dropped after."""
    trained = [param for param in model.parameters() if param.requires_grad]
    room = [torch.empty_like(param) for param in trained for _ in range(2)]
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
