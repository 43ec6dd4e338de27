"""A task of its own, as a new user writes one: tabular regression with a BatchNorm network.

tests/test_generated_project.py puts this file in place of a render's task.py (and task_settings.py next
to the project's tests) and runs the generic tests with it. It shares no field with the presets (no
dropout, no eval_fraction, no hidden_size), its model keeps running statistics, its train set draws
its augmentation from the global generators through a transform held as an attribute (not a plain value:
the data fingerprint hashes its samples), and its metrics read the config: what the generic tests must
not assume away (streamed.py: the same task, its train set a stream of its own). The data is generated
from the seed, so nothing is downloaded or shipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .utils.config import Check, ConfigError, TrainConfig, setting

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

NUM_INPUTS = 6


@dataclass
class Config(TrainConfig):
    num_rows: int = setting(2048, "rows of the generated table, a quarter of them held out for evaluation")
    width: int = setting(64, "width of the two BatchNorm hidden layers")
    jitter: float = setting(0.05, "std of the noise added to the training inputs, new each time")
    close_enough: float = setting(0.25, "an eval row counts as close when its error is below this")
    best_metric: str = "eval/mse"
    learning_rate: float = 1e-2

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/mse": "min", "eval/close": "max"}
    CHECKS: ClassVar[list[Check]] = [
        *TrainConfig.CHECKS,
        ("num_rows", lambda v: v >= 64, ">= 64"),
        ("width", lambda v: v > 0, "> 0"),
        ("jitter", lambda v: v >= 0, ">= 0"),
        ("close_enough", lambda v: v > 0, "> 0"),
    ]


def table(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets: a smooth function of the inputs plus noise, drawn from the seed alone."""
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    inputs = torch.randn(config.num_rows, NUM_INPUTS, generator=generator)
    targets = inputs[:, 0].sin() + inputs[:, 1] * inputs[:, 2] - 0.5 * inputs[:, 3]
    return inputs, targets + 0.1 * torch.randn(config.num_rows, generator=generator)


class Jittered:
    """Training rows with input noise drawn when a row is read, from torch's, numpy's and Python's global
    generators (the torchvision habit): no set_epoch, no generator of its own. The loader seeds them per
    row. A map-style dataset needs no base class, so torch loads only when the data is built."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, jitter: float) -> None:
        self.inputs, self.targets, self.jitter = inputs, targets, jitter
        self.transform = bounded  # not a plain value: the data fingerprint hashes the samples themselves

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        import numpy as np
        import torch

        noise = torch.randn(NUM_INPUTS) * np.random.uniform(0.5, 1.5) + random.gauss(0, 0.1)
        return self.inputs[index] + self.jitter * self.transform(noise), self.targets[index]


def bounded(noise: torch.Tensor) -> torch.Tensor:
    """The jitter's transform: no input moves by more than three times `jitter`."""
    return noise.clamp(-3.0, 3.0)


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    from torch.utils.data import TensorDataset

    inputs, targets = table(config)
    split = config.num_rows // 4
    train = Jittered(inputs[split:], targets[split:], config.jitter)
    return train, TensorDataset(inputs[:split], targets[:split])


def collate(samples: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    from torch.utils.data import default_collate

    return default_collate(samples)


def build_model(config: Config) -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Linear(NUM_INPUTS, config.width),
        nn.BatchNorm1d(config.width),
        nn.ReLU(),
        nn.Linear(config.width, config.width),
        nn.BatchNorm1d(config.width),
        nn.ReLU(),
        nn.Linear(config.width, 1),
    )


def loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    import torch.nn.functional as F

    inputs, targets = batch
    return F.mse_loss(model(inputs).squeeze(-1), targets)


def eval_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    return {"squared_error": (model(inputs).squeeze(-1).float() - targets) ** 2}


def metrics(values: dict[str, torch.Tensor], config: Config) -> dict[str, float]:
    errors = values["squared_error"].double()
    return {
        "eval/mse": errors.mean().item(),
        "eval/close": (errors.sqrt() < config.close_enough).double().mean().item(),
    }


def predict_inputs(config: Config, path: Path | None) -> Dataset:
    """The eval split with its targets, or the rows of a CSV file of NUM_INPUTS numbers each."""
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    if path is None:
        return build_datasets(config)[1]
    try:
        rows = np.loadtxt(path, delimiter=",", ndmin=2)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: expected a CSV file of {NUM_INPUTS} numbers per line ({error})") from None
    if rows.shape[1] != NUM_INPUTS:
        raise ConfigError(f"{path}: expected {NUM_INPUTS} numbers per line, got {rows.shape[1]}")
    return TensorDataset(torch.tensor(rows, dtype=torch.float32))


def predict(model: torch.nn.Module, batch: list[torch.Tensor], config: Config) -> list[dict[str, Any]]:
    inputs, *known = batch
    predictions = model(inputs).squeeze(-1).float().cpu().tolist()
    rows: list[dict[str, Any]] = [{"prediction": value} for value in predictions]
    for row, target in zip(rows, known[0].tolist() if known else [], strict=False):
        row["target"] = target
    return rows
