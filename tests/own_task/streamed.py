"""The own task (tests/own_task/task.py) with its train rows streamed, as a user writes a stream of their own
(docs/own-task.md, "A streamed train set"). tests/test_generated_project.py puts this file in place of a
render's task.py and the own task next to it as table_task.py, whose functions it takes as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .table_task import (  # the contract's other functions, unchanged
    NUM_INPUTS,
    bounded,
    build_model,
    collate,
    eval_step,
    loss,
    metrics,
    predict,
    predict_inputs,
    table,
)
from .table_task import Config as TableConfig

if TYPE_CHECKING:
    from torch.utils.data import Dataset

__all__ = [
    "Config",
    "build_datasets",
    "build_model",
    "collate",
    "eval_step",
    "loss",
    "metrics",
    "predict",
    "predict_inputs",
]


@dataclass
class Config(TableConfig):
    max_steps: int = 480  # a stream has no length to size training by num_epochs: 20 epochs of 24 steps
    num_workers: int = 0  # a stream of its own, not split by file: read in the main process


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    import torch
    from torch.utils.data import IterableDataset, TensorDataset

    from .utils.training.streams import check_stream_settings

    check_stream_settings(config)
    inputs, targets = table(config)
    split = config.num_rows // 4

    class Rows(IterableDataset):
        """The train rows in an order drawn from (seed, epoch), each jittered from a generator seeded from
        (seed, epoch, row): a resume reads on after the rows read. Its state: the epoch and the rows read."""

        def __init__(self) -> None:
            self.epoch, self.read = 0, 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch, self.read = epoch, 0

        def state_dict(self) -> dict[str, int]:
            return {"epoch": self.epoch, "read": self.read}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.epoch, self.read = state["epoch"], state["read"]

        def __iter__(self) -> Any:
            key = (config.seed * 1_000 + self.epoch) * config.num_rows
            order = torch.randperm(config.num_rows - split, generator=torch.Generator().manual_seed(key))
            for position in range(self.read, len(order)):
                row = split + int(order[position])
                noise = torch.randn(NUM_INPUTS, generator=torch.Generator().manual_seed(key + row))
                self.read = position + 1
                yield inputs[row] + config.jitter * bounded(noise), targets[row]

    return Rows(), TensorDataset(inputs[:split], targets[:split])
