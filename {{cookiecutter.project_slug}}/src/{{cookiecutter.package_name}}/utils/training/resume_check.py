"""The first step after a checkpoint, recorded and compared at the next resume: bitwise, or how far and why
(docs/resume.md, "Stopping and resuming")."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object


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
            history.record(step, {**digest, "session": history.current["session"]})  # which session saw it
            if self.published is not None:  # in the run folder's history at once, else with its checkpoint
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
        by = f"session {recorded['session']}" if "session" in recorded else "an earlier session"
        return "verified", f"resume verified: step {step} as {by} recorded it, bit for bit"
    loss = float.fromhex(measured["loss"])
    recorded_loss = float.fromhex(recorded["loss"])
    norm = float.fromhex(measured["grad_norm"])
    recorded_norm = float.fromhex(recorded["grad_norm"])
    batch = "the batch is the same" if recorded.get("batch") == measured["batch"] else "the batch differs"
    named = "; ".join(line.split(": ")[0] for line in changes) or "nothing the history names changed"
    return "differs", (
        f"resume differs at step {step}: loss {loss!r} against {recorded_loss!r} ({batch}): {named}; "
        f"measured: relative difference {relative(loss, recorded_loss):.1e} in the loss, "
        f"{relative(norm, recorded_norm):.1e} in the gradient norm ({norm!r} against {recorded_norm!r})"
    )


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)
