"""Seeding: one seed everywhere, and each sample's random numbers drawn from its own place in the run
(docs/resume.md, "Stopping and resuming").

Micro-batch j of process p holds the samples at place p x accumulation + j of the global batch, whatever
the number of processes and accumulation steps (for the same per-device batch): Accelerate hands process p
the p-th share of each global batch, which the loop cuts into micro-batches.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import Dataset, Subset

from ..config import TrainConfig


def seed_run(config: TrainConfig) -> None:
    """The same seed on every process; each micro-batch reseeds for its samples (follow_the_sample)."""
    set_seed(config.seed)
    # Bitwise-equal reruns and resumes on a GPU also need kernels that add in a fixed order (attention's
    # backward pass and cuBLAS do not by default). Strict: an op without such a kernel stops the run and
    # names itself, rather than quietly breaking exact resume. cuBLAS reads its setting at its first use.
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(config.deterministic)


def running_stats(accelerator: Accelerator, model: torch.nn.Module) -> tuple[list[torch.nn.Module], bool]:
    """The normalization layers that keep running statistics (BatchNorm), and whether this process's
    updates of them count. DDP starts every training forward from the main process's buffers: only its
    updates count there. FSDP and DeepSpeed copy no buffers, so each process keeps its own up to date."""
    norm = torch.nn.modules.batchnorm._NormBase
    norms = [layer for layer in model.modules() if isinstance(layer, norm) and layer.track_running_stats]
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return norms, accelerator.is_main_process or not ddp


def follow_the_sample(seed: int, step: int, place: int, device: torch.device) -> None:
    """Seed the default generators of the CPU and of `device` for the micro-batch at `place` in the global
    batch of optimizer step `step`: host-side, no device sync. Not torch.manual_seed: it also queues a
    seeding, with a stack trace, for every device kind not yet initialized (milliseconds, and a list that
    grows at every call)."""
    value = seed_of(f"{seed}/{step}/{place}")
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.default_generators[index].manual_seed(value)
    elif device.type != "cpu":  # mps, xpu, ...: in use, so initialized
        getattr(torch, device.type).manual_seed(value)


def seed_of(parts: str) -> int:
    """A 63-bit seed mixed from `parts`: neighbouring parts give unrelated seeds."""
    return int.from_bytes(hashlib.blake2b(parts.encode(), digest_size=8).digest(), "little") >> 1


class SeededItems(Dataset):
    """The train set as its loader reads it: torch's (CPU), numpy's and Python's global generators are
    seeded from (seed, epoch, index) before an item is made (main process or worker) and given back after
    each batch, so augmentation drawn from them follows the sample. A set that makes its batches itself
    (its own `__getitems__`, as digits' does) draws its random numbers as it likes."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0
        self.batches = getattr(type(dataset), "__getitems__", None) not in (None, Subset.__getitems__)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index] if self.batches else self.__getitems__([index])[0]

    def __getitems__(self, indices: list) -> Any:
        if self.batches:
            return self.dataset.__getitems__(indices)
        states = torch.get_rng_state(), np.random.get_state(), random.getstate()  # 0.1 ms: once a batch
        items = []
        for index in indices:
            value = seed_of(f"item/{self.seed}/{self.epoch}/{index}")
            torch.default_generator.manual_seed(value)
            np.random.seed(value & 0xFFFF_FFFF)
            random.seed(value)
            items.append(self.dataset[index])
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        return items
