"""Checkpoints that do not stop training: the loop stages the state in CPU memory, one thread persists it
(docs/resume.md). The other processes write their RNG file into the staging folder at once: the thread never
needs a collective."""

from __future__ import annotations

import copy
import io
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate.utils.other import clean_state_dict_for_safetensors
from safetensors.torch import save_file

from ..config import TrainConfig
from ..run.run_dir import write_error
from .checkpoint import (
    WRITE_ERRORS,
    Files,
    LoopState,
    _publish,
    _rotate,
    checkpoint_root,
    fresh_staging,
    save_checkpoint,
)

PAUSE_ENV = "CHECKPOINT_WRITE_PAUSE_S"  # tests: seconds to sleep before each file written (for a kill)
Staged = list[tuple[str, str, Any]]  # (file name, format, CPU copy) of each file a save writes


class Persister:
    """Saves checkpoints, in the background or in the loop; then calls `published()` (the mirror)."""

    def __init__(self, accelerator: Accelerator, config: TrainConfig, published: Callable[[], None]) -> None:
        self.accelerator = accelerator
        self.config = config
        self.published = published
        # FSDP and DeepSpeed save formats of their own, collectively; stage_state knows the RNG states of
        # the CPU, CUDA and MPS alone.
        self.background = (
            config.checkpoint_mode == "background"
            and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)
            and accelerator.device.type in ("cpu", "cuda", "mps")
        )
        self.staging = Staging()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")  # an error: at the next `wait`
        self._job: Future | None = None
        self._saved: Callable[[], None] | None = None  # says that the save in flight is published
        self.last_seconds = 0.0  # the last save, from staging to publish
        self.published_step = -1  # of the newest checkpoint published (on the main process)

    def save(
        self, state: LoopState, protect: Path | None, files: Files, saved: Callable[[Path], None]
    ) -> Path:
        """Save on every process (all at the same step); return the checkpoint's final path. `saved(path)`
        runs on the loop's thread once it is published: at once, or at a later `announce` or `wait`."""
        if not self.background:
            started = time.monotonic()
            final = save_checkpoint(self.accelerator, self.config, state, protect, files)
            self._done(started, state.step)
            saved(final)
            return final
        accelerator = self.accelerator
        self.wait()  # at most one save in flight
        final = checkpoint_root(self.config.output_dir) / f"step_{state.step:08d}"
        staging = fresh_staging(accelerator, final)
        staged = stage_state(accelerator, self.staging)  # the main process's files; elsewhere the RNG file
        if not accelerator.is_main_process:
            _write_file(staging, *staged[0])
        accelerator.wait_for_everyone()  # every process's file is in the staging folder: the thread seals
        if accelerator.is_main_process:
            snapshot = LoopState(**{k: copy.deepcopy(v) for k, v in vars(state).items()})
            job = (staged, snapshot, protect, dict(files), staging, final)
            self._job = self._writer.submit(self._persist, *job)
        self._saved = lambda: saved(final)
        return final

    def announce(self) -> None:
        """Called by the loop at every step: once the save in flight is published, `saved` says so. A failed
        one is left to `wait`, which every process calls at the same step."""
        if self._job is None or (self._job.done() and self._job.exception() is None):
            self.wait()

    def wait(self) -> None:
        """Until the save in flight is published (every process calls it; only the main one waits); raise
        its error, if it failed, else say it is saved."""
        job, self._job = self._job, None
        saved, self._saved = self._saved, None
        if job is not None:
            job.result()  # raises the save's error
        if saved is not None:
            saved()

    def join(self) -> None:
        """Until the save in flight is done, published or failed (at the end of the process, a crash too)."""
        if self._job is not None:
            wait_for([self._job])

    def _persist(
        self, staged: Staged, state: LoopState, protect: Path | None, files: Files, staging: Path, final: Path
    ) -> None:
        started = time.monotonic()
        try:
            self.staging.wait()  # the copies from a GPU run asynchronously
            for entry in staged:
                _write_file(staging, *entry)
            _publish(self.config, state, staging, final, files)
            _rotate(self.config, protect=protect, latest=final)
        except WRITE_ERRORS as error:  # raised in the loop at the next wait, as a synchronous save would
            raise write_error(staging, error) from None
        self._done(started, state.step)

    def _done(self, started: float, step: int) -> None:
        """The checkpoint of `step`, begun at `started`, is published (on the main process)."""
        self.last_seconds = time.monotonic() - started
        self.published_step = step
        self.published()


class Worker:
    """A thread of the main process that runs `work` each time it is woken, again after `retry_s()` seconds
    while that is not None (a failing copy), and once more when closed: what the mirror runs on."""

    def __init__(self, name: str, work: Callable[[], None], retry_s: Callable[[], float | None]) -> None:
        self.work = work
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.started = False

    def start(self) -> None:
        self._thread.start()
        self.started = True

    def wake(self) -> None:
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float) -> bool:
        """Run once more and end; False if that takes longer than `timeout` seconds (it goes on)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.retry_s())
            self._wake.clear()
            closing = self._closing
            self.work()
            if closing:
                return


class Staging:
    """The CPU buffers of a staged state, kept from one checkpoint to the next; from a GPU, page-locked and
    filled by asynchronous copies on the training stream, which the writer thread waits for (`wait`)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # the last staging's, by file name and place in the file
        self._unused: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None
        self._from_gpu = False

    def begin(self) -> None:
        """A new staging: it reuses the buffers it asks for again; `end` lets go of the others."""
        self._unused, self.buffers = self.buffers, {}
        self._copied = None
        self._from_gpu = False

    def copy(self, value: Any, key: str) -> Any:
        """`value` with its tensors copied into this staging's buffers (by `key` and their place in it)."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), key)
        if isinstance(value, dict):
            return type(value)((name, self.copy(item, f"{key}/{name}")) for name, item in value.items())
        if isinstance(value, list | tuple):
            return type(value)(self.copy(item, f"{key}/{index}") for index, item in enumerate(value))
        return value  # numbers, strings, None: immutable

    def end(self) -> None:
        """After the last copy: let go of the buffers not asked for again; mark where a GPU's copies end."""
        self._unused = {}
        if self._from_gpu:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def wait(self) -> None:
        """Until the copies are in the buffers (at once on the CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        buffer = self._unused.pop(key, None)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self.buffers[key] = buffer
        self._from_gpu = self._from_gpu or tensor.is_cuda
        return buffer


def stage_state(accelerator: Accelerator, staging: Staging) -> Staged:
    """(file name, format, CPU copy) of each file `accelerator.save_state` writes from this process (the
    main one: all; the others: their RNG file), into `staging`'s buffers. No sampler file: save_state writes
    one for prepared iterable datasets only, which train.py has none of."""
    rng = {
        "step": accelerator.step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    rng_file = (f"random_states_{accelerator.process_index}.pkl", "torch", _pickled(rng))
    if not accelerator.is_main_process:
        return [rng_file]
    staging.begin()
    staged = []
    weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
    for hook in accelerator._save_model_state_pre_hook.values():  # e.g. the frozen weights left out
        hook(accelerator._models, weights, "")
    for index, state in enumerate(weights):
        name = "model.safetensors" if index == 0 else f"model_{index}.safetensors"
        staged.append((name, "safetensors", staging.copy(clean_state_dict_for_safetensors(state), name)))
    for kind, objects in (("optimizer", accelerator._optimizers), ("scheduler", accelerator._schedulers)):
        for index, obj in enumerate(objects):
            name = f"{kind}{f'_{index}' if index else ''}.bin"
            staged.append((name, "torch", staging.copy(obj.state_dict(), name)))
    staging.end()
    if accelerator.scaler is not None:
        staged.append(("scaler.pt", "torch", _pickled(accelerator.scaler.state_dict())))
    for index, obj in enumerate(accelerator._custom_objects):
        staged.append((f"custom_checkpoint_{index}.pkl", "torch", _pickled(obj.state_dict())))
    return [*staged, rng_file]


def _pickled(value: Any) -> bytes:
    """Small objects are serialized at once: what they hold is copied, whatever it is."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _write_file(folder: Path, name: str, kind: str, value: Any) -> None:
    if pause := float(os.environ.get(PAUSE_ENV, "0") or 0):
        time.sleep(pause)
    folder.mkdir(parents=True, exist_ok=True)  # by the first file written there, of any process
    path = folder / name
    if isinstance(value, bytes):
        path.write_bytes(value)
    elif kind == "safetensors":
        save_file(value, str(path), metadata={"format": "pt"})
    else:
        torch.save(value, path)
