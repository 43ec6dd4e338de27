"""`auto_batch_size: true`: the largest per-device batch that trains without running out of memory; the global
batch, and so the optimization, stay (more accumulation)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from .. import task
from .config import ConfigError, TrainConfig, gradient_accumulation_steps
from .run_dir import RunError
from .task_check import TaskModel


def fit_batch_size(
    accelerator: Accelerator, config: TrainConfig, model: torch.nn.Module, train_set: Any
) -> None:
    """Try a training step of per_device_batch_size samples on the model, not prepared yet (no process waits
    on another), then each smaller size that divides a process's share of the global batch, until one fits;
    all processes take the smallest that fitted. The tries leave no random state, buffers or gradients."""
    if not config.auto_batch_size:
        return
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError("auto_batch_size tries the whole model on one device: set per_device_batch_size")
    share = config.global_batch_size // accelerator.num_processes
    sizes = [size for size in range(config.per_device_batch_size, 0, -1) if share % size == 0]
    model.to(accelerator.device).train()  # where prepare puts it
    buffers = [buffer.clone() for buffer in model.buffers()]  # BatchNorm's statistics
    host_generators = np.random.get_state(), random.getstate()  # a task's items or loss may draw from them
    with torch.random.fork_rng(devices=[] if accelerator.device.type == "cpu" else [accelerator.device]):
        fitted = next((size for size in sizes if fits(accelerator, model, train_set, size)), 0)
    np.random.set_state(host_generators[0])
    random.setstate(host_generators[1])
    with torch.no_grad():
        for buffer, kept in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(kept)
    size = int(accelerator.gather(torch.tensor([fitted], device=accelerator.device)).min())
    if size == 0:
        raise RunError("auto_batch_size: a per-device batch of 1 runs out of memory: use a smaller model")
    failed = ", ".join(str(larger) for larger in sizes if larger > size)
    config.per_device_batch_size = size
    accumulation = gradient_accumulation_steps(config, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = accumulation
    accelerator.print(
        f"auto_batch_size: per-device batch {size} x {accumulation} accumulation = global batch "
        f"{config.global_batch_size} ({f'{failed} ran out of memory' if failed else 'it fits'})"
    )


def fits(accelerator: Accelerator, model: torch.nn.Module, train_set: Any, size: int) -> bool:
    """Whether a forward and backward of `size` samples fit, with room held for what the first optimizer
    step allocates (AdamW's two moments) and DDP's gradient buckets. Gradients are dropped after."""
    trained = [param for param in model.parameters() if param.requires_grad]
    room = [torch.empty_like(param) for param in trained for _ in range(2 + (accelerator.num_processes > 1))]
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
