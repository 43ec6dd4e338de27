"""Training from a stream (docs/own-task.md), resumed exactly. Every process reads the same stream in the same
(seeded) order, and Accelerate's IterableDatasetShard keeps this process's block of each global batch: a step
sees the same samples on 1 or N processes. Workers (torchdata's StatefulDataLoader) each read whole files
of a `datasets` stream (file i goes to worker i mod num_workers; so num_workers is part of the order) and
take turns giving a batch; the loader's state resumes at the next batch on any number of processes. A
worker iterates with `datasets`' `iter()`: as a torch IterableDataset, `datasets` (5.2) would split it again
by worker and load the saved position into the unsplit stream (an IndexError on resume)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard
from accelerate.utils import send_to_device
from torch.utils.data import IterableDataset, get_worker_info

from ..config import ConfigError, TrainConfig
from ..machine.packages import require
from ..run.fingerprint import stream_chain
from ..run.run_dir import RunError
from .signals import ignore_stop_signals


def check_stream_settings(config: TrainConfig) -> None:
    """Raise a ConfigError for the settings a streamed train set cannot honour (before a task's long scan)."""
    if not config.max_steps:
        raise ConfigError(
            "a streamed train set has no length to size training by num_epochs: set max_steps (optimizer "
            "steps; epochs then end when the stream runs out)"
        )
    if config.auto_batch_size:  # its tries read samples by index
        raise ConfigError("auto_batch_size needs a map-style train set: set per_device_batch_size instead")


def shuffle_buffer(stream: IterableDataset) -> int:
    """The size of the shuffle buffer of a Hugging Face `datasets` stream (0: none, or another stream)."""
    largest = max((getattr(iterable, "buffer_size", 0) or 0 for iterable in stream_chain(stream)), default=0)
    return largest if largest > 1 else 0


# torchdata 0.11 calls torch.set_vital at each iter(), which torch 2.13 deprecates: a warning per epoch.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


# num_workers -1 (the default): a stream is read in 2 processes (bench/streams.py), data in memory without
# workers (they start again every epoch). The same on every platform: it is part of a stream's order.
STREAM_WORKERS = 2


def loader_workers(config: TrainConfig, streamed: bool) -> int:
    """The worker processes a loader gets from `num_workers` (-1: STREAM_WORKERS for a stream, else 0)."""
    if config.num_workers >= 0:
        return config.num_workers
    return STREAM_WORKERS if streamed else 0


def stream_workers(stream: IterableDataset, num_workers: int) -> int:
    """The workers that read the stream: each needs whole files, so no more than its files. Raise a
    ConfigError for a stream that cannot be dealt out (every worker would read all of it)."""
    files = getattr(stream, "num_shards", None)
    if num_workers and (files is None or not hasattr(stream, "shard")):
        raise ConfigError(
            f"num_workers={num_workers}: this {type(stream).__name__} train stream cannot be dealt among "
            "workers (a `datasets` stream can: shard()): set num_workers 0"
        )
    return min(num_workers, files) if files is not None else num_workers


class WorkerShare(IterableDataset):
    """This process's block of each global batch, from the part of the stream this worker reads (the
    whole stream without workers), its rows shuffled in windows of `window` (off below 2): each window's
    order is drawn from (seed, epoch, worker, window), so a resume re-reads the window it stopped in and
    draws the same order. Its state: the part's position at that window's start, and the rows taken."""

    def __init__(self, stream: Any, sizes: tuple[int, int, int], window: int, seed: int) -> None:
        self.stream = stream
        self.window = window
        self.seed = seed
        self.epoch = 0
        self.per_process, self.processes, self.index = sizes
        self.part: Any = None  # this worker's stream, once iterated
        self.saved: dict[str, Any] | None = None  # a position to resume from, at the next iter()
        self.at = {"window": 0, "taken": 0}  # the window in progress, and how many of its rows were taken
        self.start: dict[str, Any] | None = None  # the part's position there (None: the epoch's start)

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)  # the order of this epoch (datasets: the files' order)
        self.epoch = epoch

    def split(self) -> Any:
        worker = get_worker_info()
        if worker is None:
            return self.stream
        return self.stream.shard(num_shards=worker.num_workers, index=worker.id, contiguous=False)

    def read(self) -> Iterator[Any]:
        if hasattr(self.part, "iter"):  # a `datasets` stream: not its __iter__, which splits by worker
            for batch in self.part.iter(batch_size=1):
                yield {key: values[0] for key, values in batch.items()}
        else:
            yield from self.part

    def rows(self) -> Iterator[Any]:
        if self.window < 2:
            yield from self.read()
            return
        reader = self.read()
        worker = get_worker_info()
        window = self.at["window"]
        skip = self.at["taken"]
        while True:
            if window > self.at["window"]:  # the first one's start is known (the epoch's, or a resume's)
                self.start = self.part.state_dict()
            rows = list(itertools.islice(reader, self.window))
            if not rows:
                return
            key = [self.seed, self.epoch, worker.id if worker else 0, window]
            for taken, row in enumerate(np.random.default_rng(key).permutation(len(rows))[skip:], skip + 1):
                self.at = {"window": window, "taken": taken}
                yield rows[row]
            window += 1
            skip = 0

    def __iter__(self) -> Iterator[Any]:
        self.part = self.split()
        if self.saved is not None and self.window < 2:
            self.part.load_state_dict(self.saved)
        windowed = self.saved if self.saved is not None and self.window >= 2 else {}
        self.start = windowed.get("stream")  # the part's position at the window's start
        self.at = {"window": windowed.get("window", 0), "taken": windowed.get("taken", 0)}
        if self.start is not None:
            self.part.load_state_dict(self.start)
        self.saved = None
        share = IterableDatasetShard(
            self.rows(),  # run at the first batch, when the state above is in place
            batch_size=self.per_process,
            drop_last=True,
            num_processes=self.processes,
            process_index=self.index,
        )
        return iter(share)

    # Called by StatefulDataLoader in the process that reads (a worker, or this one), after each batch.
    def state_dict(self) -> dict[str, Any]:
        if self.saved is not None:  # not yet iterated
            return self.saved
        if self.window < 2:
            return (self.part or self.split()).state_dict()
        return {"stream": self.start, **self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state


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
                "exactly (datasets saves its position, not the buffer's contents): give the task's Config "
                "a `shuffle_window: int` field instead (rows shuffled in windows of that many, resumed "
                "exactly; docs/own-task.md), or write each file's rows in random order"
            )
        asked = loader_workers(config, streamed=True)
        self.num_workers = stream_workers(stream, asked)  # part of the order: saved, and kept
        if self.num_workers < asked and getattr(accelerator, "is_main_process", True):
            print(
                f"num_workers {asked} -> {self.num_workers}: each worker reads whole files and the train "
                f"stream has {self.num_workers}; split the data into more files for more workers"
            )
        self.stream = stream
        self.max_steps = config.max_steps
        self.resumed = False  # loaded from a checkpoint: its epoch may have no full global batch left
        self.device = accelerator.device
        self.pin_memory = pin_memory
        per_process = config.global_batch_size // accelerator.num_processes  # per-device x accumulation
        sizes = per_process, accelerator.num_processes, accelerator.process_index
        self.window = getattr(config, "shuffle_window", 0)  # a task's field (the text preset's)
        share = WorkerShare(stream, sizes, self.window, config.seed)
        # torchdata: in the data extra (pyproject.toml), as only a streamed train set needs it.
        stateful = require("torchdata.stateful_dataloader", "torchdata>=0.11")
        self.loader = stateful.StatefulDataLoader(
            share,
            batch_size=per_process,
            collate_fn=collate,
            num_workers=self.num_workers,
            worker_init_fn=ignore_stop_signals,
            pin_memory=pin_memory,
            # Each iter() draws a seed from the generator (the global one, without it, which would shift
            # the dropout masks of a resumed run), and its state holds that seed: the same on every process.
            generator=torch.Generator().manual_seed(config.seed),
        )

    def set_epoch(self, epoch: int) -> None:
        self.loader.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        resumed = self.resumed
        self.resumed = False
        batches = 0
        for batch in self.loader:
            batches += 1
            yield send_to_device(batch, self.device, non_blocking=self.pin_memory)
        if not batches and not resumed:  # an epoch without a step would loop for ever
            raise RunError(
                "the train stream ran out before one global batch: it has fewer samples than "
                "global_batch_size; add data or lower global_batch_size"
            )

    def close(self) -> None:
        """End the workers, which torchdata keeps for state_dict: at exit, they would be awaited for ever."""
        self.loader._iterator = None

    # What save_state stores (custom_checkpoint_0.pkl), with max_steps (it sizes a stream's schedule) and
    # num_workers (which worker reads which file): a resume with another would change the run.
    def state_dict(self) -> dict[str, Any]:
        saved = {"loader": self.loader.state_dict()}
        return saved | {"max_steps": self.max_steps, "num_workers": self.num_workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("max_steps", "num_workers"):
            if state.get(name, 0) != getattr(self, name):
                raise RunError(
                    f"this run streams its train set with {name}={state.get(name, 0)}, not "
                    f"{getattr(self, name)}: rerun with --{name} {state.get(name, 0)}, or start another "
                    "output_dir"
                )
        self.loader.load_state_dict(state["loader"])
        self.resumed = True
