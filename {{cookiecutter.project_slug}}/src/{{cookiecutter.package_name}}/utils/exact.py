"""Exact by construction, and shown at every resume (docs/resume.md, "Stopping and resuming").

Micro-batch j of process p holds the samples at place p x accumulation + j of the global batch, whatever
the number of processes and accumulation steps (for the same per-device batch): Accelerate hands process p
the p-th share of each global batch, which the loop cuts into micro-batches.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from torch.utils.data import Dataset, Subset

from .config import TrainConfig


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
        self.dataset, self.seed, self.epoch = dataset, seed, 0
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


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch (a tensor, or mappings, lists and tuples of them), mappings in key order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for key in sorted(batch, key=str):
            yield from batch_tensors(batch[key])
    elif isinstance(batch, list | tuple):
        for item in batch:
            yield from batch_tensors(item)


def sample_hashes(batch: Any) -> list[str]:
    """One hash per sample of a micro-batch: its rows of every tensor in the batch, as bytes, trailing zero
    bytes aside: a sample padded (with zeros) to the longest of 64 samples on 1 process or of 32 on each of
    2 is the same sample."""
    leaves = [leaf.detach().cpu() for leaf in batch_tensors(batch)]
    rows = leaves[0].shape[0] if leaves and leaves[0].dim() else 1
    hashes = [hashlib.blake2b(digest_size=16) for _ in range(rows)]
    for leaf in leaves:
        per_row = leaf.dim() > 0 and leaf.shape[0] == rows
        data = leaf.contiguous().reshape(rows if per_row else 1, -1).view(torch.uint8).numpy()
        for row, digest in enumerate(hashes):
            kept = data[row if per_row else 0].tobytes().rstrip(b"\0")
            digest.update(len(kept).to_bytes(8, "little") + kept)
    return [digest.hexdigest() for digest in hashes]


class StepDigest:
    """One optimizer step's batch, loss and gradient norm, as bits; inactive (free) on other steps."""

    def __init__(self, accelerator: Any, active: bool) -> None:
        self.accelerator = accelerator
        self.active = active
        self.first_place = accelerator.process_index * accelerator.gradient_accumulation_steps
        self.micro: list[tuple[int, list[str], torch.Tensor]] = []
        self.norm: torch.Tensor | float | None = None  # set by the loop: clip_grad_norm_'s return

    def add(self, micro_batch: Any, loss: torch.Tensor) -> None:
        if self.active:
            place = self.first_place + len(self.micro)
            self.micro.append((place, sample_hashes(micro_batch), loss.detach().float()))

    def result(self) -> dict[str, Any]:
        """The step as every process saw it (one gather: a collective): the batch's hash over its samples
        in global order, their count, the mean loss over the micro-batches and the gradient norm."""
        own = [(place, hashes, loss.item()) for place, hashes, loss in self.micro]
        gathered = sorted(gather_object(own))
        samples = [sample for _, hashes, _ in gathered for sample in hashes]
        loss = math.fsum(value for *_, value in gathered) / len(gathered)
        norm = float(self.norm) if self.norm is not None else math.nan
        return {
            "batch": hashlib.sha256("".join(samples).encode()).hexdigest(),
            "samples": len(samples),
            "loss": loss.hex(),
            "grad_norm": norm.hex(),
        }


class ResumeCheck:
    """Which steps are recorded, the records in the history, and the resumed first step's `verdict`."""

    def __init__(
        self,
        accelerator: Any,
        history: Any,
        output_dir: str,
        write: Callable[[str], None],
        resumed_at: int | None,
    ) -> None:
        self.accelerator = accelerator
        self.history = history
        self.output_dir = output_dir
        self.write = write
        self.record_at = self.verify_at = -1 if resumed_at is None else resumed_at
        self.published = resumed_at  # the newest checkpoint published: the history claims no later step
        self.digest = StepDigest(accelerator, False)

    def step_digest(self, step: int) -> StepDigest:
        """What the loop records of the step it starts: active on the first step after a checkpoint."""
        self.digest = StepDigest(self.accelerator, step in (self.record_at, self.verify_at))
        return self.digest

    def saved(self, step: int, why: str, path: Path) -> None:
        """The checkpoint of `step` is published: the run folder's history may name it now."""
        self.published = step
        self.history.save(self.output_dir, step, why)
        self.write(f"checkpoint: step {step} saved to {path}")

    def probe(self, step: int, batch: Any, gradients: Callable[..., Any], model: torch.nn.Module) -> None:
        """Record the step after the checkpoint of `step` without taking it: forward and backward of its
        batch as the loop does them, no BatchNorm update, no optimizer or schedule step, gradients dropped."""
        self.digest = StepDigest(self.accelerator, True)
        gradients(batch, self.digest, tracking=False)
        for param in model.parameters():
            param.grad = None  # as optimizer.zero_grad() leaves them
        self.digested(step)

    def digested(self, step: int) -> None:
        """After the step that `step` counts: recorded for later resumes, if it was the first after a
        checkpoint; after this session's resume, compared too, in one line, which the history keeps."""
        if not self.digest.active:
            return
        digest = self.digest.result()
        history = self.history
        main = self.accelerator.is_main_process
        if step == self.verify_at and main:
            kind, line = verdict(history.recorded(step), digest, step + 1, history.changes())
            self.write(line)
            history.current.update(resume=kind, resume_line=line)
        self.verify_at = -1
        if main:
            history.record(step, digest)  # in the next checkpoint's history, and in the run folder's:
            if self.published is not None:  # at once where its checkpoint is published, else once it is
                history.save(self.output_dir, self.published)


def verdict(
    recorded: dict[str, Any] | None, measured: dict[str, Any], step: int, changes: list[str]
) -> tuple[str, str]:
    """The resume's verdict (verified, differs, not recorded) and its one line: step `step` (1-based)
    against what the uninterrupted run recorded of it."""
    if recorded is None:
        why = (
            "no session before this one reached it: killed right after the checkpoint, a stream stopped "
            "there (its next batch is not read ahead), or a checkpoint older than these records"
        )
        return "not recorded", f"resume not verified: nothing was recorded of step {step} ({why})"
    if all(recorded.get(key) == measured[key] for key in ("batch", "samples", "loss", "grad_norm")):
        return "verified", f"resume verified: step {step} is bit for bit the uninterrupted run's"
    loss, was = float.fromhex(measured["loss"]), float.fromhex(recorded["loss"])
    norm, norm_was = float.fromhex(measured["grad_norm"]), float.fromhex(recorded["grad_norm"])
    batch = "the batch is the same" if recorded.get("batch") == measured["batch"] else "the batch differs"
    named = "; ".join(line.split(": ")[0] for line in changes) or "nothing the history names changed"
    return "differs", (
        f"resume differs at step {step}: loss {loss!r} against {was!r} ({batch}): {named}; measured: "
        f"relative difference {relative(loss, was):.1e} in the loss, {relative(norm, norm_was):.1e} in the "
        f"gradient norm ({norm!r} against {norm_was!r})"
    )


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)
