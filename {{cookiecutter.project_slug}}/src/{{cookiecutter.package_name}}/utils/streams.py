"""Training from a stream: a train set that is a torch IterableDataset (a Hugging Face `datasets` stream
read from local files, or your own with `state_dict`/`load_state_dict` and `set_epoch`), resumed exactly.

How each process gets its share without changing the optimization: every process reads the same stream,
in the same (seeded) order, and Accelerate's IterableDatasetShard keeps, of each run of global batch
samples, this process's block. So an optimizer step sees the same samples on 1 or N processes. It reads a
whole global batch before yielding any of it, and the plain DataLoader below reads nothing ahead: at every
step boundary the stream stands at the same place on every process, the place a single process would
be. That place is the stream's own `state_dict`, which Accelerate's `save_state` stores in the checkpoint
(`register_for_checkpointing`: one file, whatever the number of processes), so a resume, also on another
number of processes, continues at the next sample. There is no length: an epoch ends when the stream runs
out (the last, partial global batch is dropped), and `max_steps` sets the length of training.

Not here: worker processes (they would split the stream by file, which changes the order),
`auto_batch_size` (it probes with indexed samples), and a `datasets` shuffle buffer (its contents are not
in the saved state: a resume would draw other samples). The eval set stays map-style.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset

from .config import ConfigError, TrainConfig
from .run_dir import RunError
from .signals import ignore_stop_signals


def check_stream_settings(config: TrainConfig) -> None:
    """Raise a ConfigError for the settings a streamed train set cannot honour; a task calls it before it
    reads its files, so that a long scan does not come before the error."""
    if not config.max_steps:
        raise ConfigError(
            "a streamed train set has no length to size training by num_epochs: set max_steps (optimizer "
            "steps; epochs then end when the stream runs out)"
        )
    if config.num_workers:
        raise ConfigError(
            f"num_workers={config.num_workers}: a streamed train set is read in the training process, since "
            "workers would split it by file and change its order (and exact resume): set num_workers 0"
        )
    if config.auto_batch_size:
        raise ConfigError("auto_batch_size needs a map-style train set: set per_device_batch_size instead")


def shuffle_buffer(stream: IterableDataset) -> int:
    """The size of the shuffle buffer of a Hugging Face `datasets` stream (0: none, or another stream)."""
    pending, largest = [getattr(stream, "_ex_iterable", None)], 0
    while pending:
        iterable = pending.pop()
        if iterable is not None:
            largest = max(largest, getattr(iterable, "buffer_size", 0) or 0)
            pending += [getattr(iterable, "ex_iterable", None), *getattr(iterable, "ex_iterables", [])]
    return largest if largest > 1 else 0


class StreamLoader:
    """The train loader over a stream: batches of this process's share, on the device, and the stream's
    position for checkpoints. Not a DataLoader, so `accelerator.prepare` passes it through unchanged
    (Accelerate would send an iterable dataset from the main process to the others, reading ahead)."""

    def __init__(
        self,
        stream: IterableDataset,
        config: TrainConfig,
        accelerator: Accelerator,
        collate: Callable[[list[Any]], Any],
        pin_memory: bool,
    ) -> None:
        check_stream_settings(config)
        for method in ("state_dict", "load_state_dict", "set_epoch"):
            if not hasattr(stream, method):
                raise ConfigError(
                    f"build_datasets returned a {type(stream).__name__} train stream without {method}(): "
                    "exact resume and a new order each epoch need state_dict, load_state_dict and set_epoch"
                )
        if buffer := shuffle_buffer(stream):
            raise ConfigError(
                f"the train stream shuffles through a buffer of {buffer} samples, which cannot be resumed "
                "exactly (datasets saves its position, not the buffer's contents): shuffle with "
                "buffer_size=1 (the order of the files) and write each file's rows in random order"
            )
        self.stream, self.max_steps = stream, config.max_steps
        self.resumed = False  # loaded from a checkpoint: its epoch may have no full global batch left
        self.device = accelerator.device
        self.pin_memory = pin_memory
        per_process = config.global_batch_size // accelerator.num_processes  # per-device x accumulation
        share = IterableDatasetShard(
            stream,
            batch_size=per_process,
            drop_last=True,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
        )
        self.loader = DataLoader(
            share,
            batch_size=per_process,
            collate_fn=collate,
            worker_init_fn=ignore_stop_signals,
            pin_memory=pin_memory,
            # Each iter() of a DataLoader draws a seed from its generator: from the global one, without it,
            # which would shift the dropout masks of a resumed run (it starts an iterator mid-epoch).
            generator=torch.Generator().manual_seed(config.seed),
        )

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)  # the order of this epoch (datasets: the files' order)

    def __iter__(self) -> Iterator[Any]:
        resumed, self.resumed = self.resumed, False
        batches = 0
        for batch in self.loader:
            batches += 1
            yield send_to_device(batch, self.device, non_blocking=self.pin_memory)
        if not batches and not resumed:  # an epoch without a step would loop for ever
            raise RunError(
                "the train stream ran out before one global batch: it has fewer samples than "
                "global_batch_size; add data or lower global_batch_size"
            )

    # What save_state stores (custom_checkpoint_0.pkl) and load_state gives back. max_steps rides along:
    # it sizes a stream's schedule, so a resume with another value would change the run, not continue it.
    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "max_steps": self.max_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["max_steps"] != self.max_steps:
            raise RunError(
                f"this run streams its train set with a schedule of max_steps={state['max_steps']}, not "
                f"{self.max_steps}: rerun with --max_steps {state['max_steps']}, or start another output_dir"
            )
        try:  # the next iteration of the saved epoch starts after it
            self.stream.load_state_dict(state["stream"])
        except (IndexError, KeyError, ValueError) as error:  # datasets' own, for a position in other files
            raise RunError(
                f"the train stream's saved position does not fit its files now ({error!r}): a stream "
                "continues only over the files it was saved with (continue_on_new_data too): restore them, "
                "or start another output_dir"
            ) from None
        self.resumed = True
