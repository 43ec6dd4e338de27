"""The task: all that train.py and predict.py know about the data, the model and the metrics. Digits:
classify 8x8 handwritten digits (data/digits.csv) with a small MLP. Your own task: docs/own-task.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .utils.config import Check, ConfigError, TrainConfig, setting

# torch and the data/ and models/ modules load inside the functions: --help answers at once (own-task.md).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from .data.digits import DigitBatch


@dataclass
class Config(TrainConfig):
    eval_fraction: float = setting(0.2, "share of the images held out for evaluation")
    augment_noise: float = setting(0.05, "std of the Gaussian pixel noise added to training images (0: off)")
    hidden_size: int = setting(256, "width of the MLP's two hidden layers")
    dropout: float = setting(0.1, "dropout after each hidden layer")
    # TrainConfig's defaults that this task sets otherwise.
    best_metric: str = "eval/accuracy"

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/accuracy": "max", "eval/loss": "min"}
    CHECKS: ClassVar[list[Check]] = [
        *TrainConfig.CHECKS,
        ("eval_fraction", lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"),
        ("augment_noise", lambda v: v >= 0, ">= 0"),
        ("hidden_size", lambda v: v > 0, "> 0"),
        ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    from .data.digits import digit_splits

    return digit_splits(config.seed, config.eval_fraction, config.augment_noise)


def collate(samples: list[tuple[torch.Tensor, ...]] | DigitBatch) -> list[torch.Tensor] | DigitBatch:
    """(images, labels) pairs (or images alone, to predict) stacked into a batch; the training set's
    `__getitems__` hands over its batches already stacked."""
    from torch.utils.data import default_collate

    from .data.digits import DigitBatch

    return samples if isinstance(samples, DigitBatch) else default_collate(samples)


def build_model(config: Config) -> torch.nn.Module:
    from .data.digits import NUM_CLASSES, NUM_FEATURES
    from .models.mlp import build_mlp

    return build_mlp(NUM_FEATURES, NUM_CLASSES, config.hidden_size, config.dropout)


def loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    import torch.nn.functional as F

    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def eval_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    inputs, labels = batch
    logits = model(inputs).float()
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),
        "hit": (logits.argmax(dim=-1) == labels).float(),
    }


def metrics(values: dict[str, torch.Tensor], config: Config) -> dict[str, float]:
    return {
        "eval/loss": values["loss"].double().mean().item(),
        "eval/accuracy": values["hit"].sum().item() / values["hit"].numel(),
    }


def predict_inputs(config: Config, path: Path | None) -> Dataset:
    """The eval split with labels and the line of data/digits.csv that holds each, or the images of a CSV
    file (docs/task.md, "Predictions")."""
    import torch
    from torch.utils.data import TensorDataset

    from .data.digits import split_rows

    if path is None:
        train_set, eval_set = build_datasets(config)
        rows, _ = split_rows(len(train_set) + len(eval_set), config.seed, config.eval_fraction)
        return TensorDataset(*eval_set.tensors, torch.from_numpy(rows + 1))  # 1-based, as editors count
    return TensorDataset(read_pixels(path))


def predict(model: torch.nn.Module, batch: list[torch.Tensor], config: Config) -> list[dict[str, Any]]:
    """The output rows of docs/task.md ("Predictions"), with the line of data/digits.csv of an eval image."""
    inputs, *known = batch
    probs = model(inputs).float().softmax(dim=-1).cpu()
    rows = []
    for index, row in enumerate(probs.tolist()):
        out: dict[str, Any] = {"prediction": int(probs[index].argmax())}
        if known:
            labels, lines = known
            out |= {"label": int(labels[index]), "line": int(lines[index])}
        out.update({f"prob_{digit}": p for digit, p in enumerate(row)})
        rows.append(out)
    return rows


def read_pixels(path: Path) -> torch.Tensor:
    """The images of a pixel CSV as model inputs; a ConfigError names the file, and the line of a bad row."""
    import numpy as np
    import torch

    from .data.digits import MAX_PIXEL, NUM_FEATURES

    expected = f"a CSV file of {NUM_FEATURES} comma-separated pixel values 0..16 per line (8x8, row by row)"
    lines = read_input_lines(path, expected)
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            values = [float(cell) for cell in line.split(",")]
        except ValueError:
            raise ConfigError(f"{path}:{number}: not a number in {line[:80]!r}") from None
        if len(values) != NUM_FEATURES:
            raise ConfigError(
                f"{path}:{number}: expected {NUM_FEATURES} comma-separated pixel values, got {len(values)}"
            )
        bad = [v for v in values if not (math.isfinite(v) and 0 <= v <= MAX_PIXEL)]
        if bad:
            raise ConfigError(f"{path}:{number}: pixel values must be between 0 and 16, got {bad[0]}")
        rows.append(values)
    if not rows:
        raise ConfigError(f"{path}: no rows of pixel values; expected {expected}")
    # The same scaling as the training data, so that a file of eval images gives the eval predictions.
    return torch.tensor(np.array(rows, dtype=np.float64) / MAX_PIXEL, dtype=torch.float32)


def read_input_lines(path: Path, expected: str) -> list[str]:
    """The lines of the text file `path`; a ConfigError names it, and what was expected, if it is not one."""
    if path.is_dir():
        raise ConfigError(f"input {path} is a folder; expected {expected}")
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a spreadsheet's byte order mark
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not a text file (byte {error.object[error.start]:#04x} at offset {error.start} is not "
            f"UTF-8); expected {expected}"
        ) from None
    except OSError as error:
        raise ConfigError(f"cannot read input file {path}: {error.strerror or error}") from None
