"""The largest per-device batch that fits in memory, with the same global batch (`auto_batch_size: true`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from accelerate.utils.operations import send_to_device, slice_tensors

from .. import task
from .config import TrainConfig, gradient_accumulation_steps
from .task_check import TaskModel


def batch_size_candidates(per_device_batch_size: int, global_batch_size: int, processes: int) -> list[int]:
    """Per-device batch sizes to try, largest first: at most the configured one, and each one divides a
    process's share of the global batch, so that accumulation can make up the rest exactly."""
    share = global_batch_size // processes
    return [size for size in range(min(per_device_batch_size, share), 0, -1) if share % size == 0]


def fit_batch_size(
    accelerator: Accelerator,
    model: torch.nn.Module,
    candidates: list[int],
    train_step: Callable[[int], None],
) -> int:
    """The largest of `candidates` for which `train_step(size)`, a forward and backward, fits in memory.

    Each try runs without gradient synchronisation (a process that runs out must not leave the others
    waiting in an all-reduce) and leaves no trace: random state, buffers (e.g. batch-norm statistics)
    and gradients are restored. Room for AdamW's two moment buffers, which its first step allocates,
    is held during the try. All processes then take the smallest size any of them found.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    cuda = [accelerator.device.index or 0] if accelerator.device.type == "cuda" else []
    chosen = 0
    with torch.random.fork_rng(devices=cuda):
        for size in candidates:
            reserve = [torch.empty_like(p) for p in params for _ in range(2)]
            try:
                with accelerator.no_sync(model):
                    train_step(size)
                chosen = size
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
            finally:
                del reserve
                model.zero_grad(set_to_none=True)
                clear_device_cache(garbage_collection=True)
            if chosen:
                break
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    agreed = int(accelerator.gather(torch.tensor([chosen], device=accelerator.device)).min())
    if agreed == 0:
        raise RuntimeError(
            f"out of memory even with a per-device batch of {candidates[-1]}: use a smaller model, "
            "mixed_precision bf16/fp16, or a device with more memory"
        )
    return agreed


def auto_batch_size(
    accelerator: Accelerator, model: torch.nn.Module, config: TrainConfig, train_set: Any
) -> None:
    """`auto_batch_size: true`: set per_device_batch_size to the largest candidate that fits, and the
    gradient accumulation that keeps global_batch_size (on `config` and `accelerator`). Off: nothing."""
    if not config.auto_batch_size:
        return
    candidates = batch_size_candidates(
        config.per_device_batch_size, config.global_batch_size, accelerator.num_processes
    )
    samples = task.collate([train_set[i] for i in range(candidates[0])])
    probe_batch = send_to_device(samples, accelerator.device)

    view = TaskModel(model, accelerator.unwrap_model(model), training=True)  # as the loop passes it

    def train_step(size: int) -> None:
        accelerator.backward(task.loss(view, slice_tensors(probe_batch, slice(0, size))))

    config.per_device_batch_size = fit_batch_size(accelerator, model, candidates, train_step)
    accumulation = gradient_accumulation_steps(config, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = accumulation
    accelerator.print(
        f"auto_batch_size: per-device batch {config.per_device_batch_size} x {accumulation} accumulation"
    )
