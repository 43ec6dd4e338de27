"""Handwritten digits (1,797 8x8 images) of data/digits.csv (data/README.md says where they come from).
Replace this module with your own data; task.py is the only caller."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..utils.config import ConfigError
from ..utils.run.fingerprint import values_xxh3

PROJECT_DIR = Path(__file__).resolve().parents[3]  # src/<package>/data/digits.py -> the folder with train.py
DATA_FILE = PROJECT_DIR / "data" / "digits.csv"  # one image per line: 64 pixel values, then the digit

NUM_FEATURES = 64
NUM_CLASSES = 10
MAX_PIXEL = 16.0  # pixel values are 0..16


class DigitBatch(NamedTuple):
    """A training batch that is already stacked: the task's collate passes it through as it is."""

    images: torch.Tensor
    labels: torch.Tensor


class NoisyDigits(Dataset):
    """Training images with Gaussian pixel noise, a function of (seed, epoch, index) only (docs/resume.md).
    One generator seeded with (seed, epoch) draws the epoch's noise at once, and `__getitems__` hands over
    a stacked batch: a generator per image, or a batch cut into images to stack again, kept a GPU waiting."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, noise: float, seed: int) -> None:
        self.features = features
        self.labels = labels
        self.noise = noise
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        # Called more than once per epoch (train.py, and Accelerate's loader at each iter): draw once.
        if getattr(self, "epoch", None) == epoch:
            return
        self.epoch = epoch
        self.images = self.features
        if self.noise:
            # torch draws the epoch's 92k values in a third of numpy's time; SeedSequence mixes (seed, epoch).
            key = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0])
            generator = torch.Generator().manual_seed(key)
            noise = torch.randn(self.features.shape, generator=generator)
            self.images = noise.mul_(self.noise).add_(self.features)

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> dict[str, str]:
        """What a run's data fingerprint (utils/run/fingerprint.py) records: the images and labels, not the
        epoch's noise, which is drawn (torch's generator may round otherwise on another CPU or version)."""
        return {"samples": f"{len(self)} samples, xxh3 {values_xxh3((self.features, self.labels))}"}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> DigitBatch:
        rows = torch.as_tensor(indices)
        return DigitBatch(self.images[rows], self.labels[rows])


def digit_splits(seed: int, eval_fraction: float, noise: float) -> tuple[NoisyDigits, TensorDataset]:
    """(train, eval) datasets of (features, label) pairs, features scaled to 0..1, split by `seed` alone."""
    if not DATA_FILE.is_file():
        raise ConfigError(
            f"{DATA_FILE} does not exist: the data ships in the project's data/ folder, which an install "
            "with pip install -e . (not pip install .) keeps in reach"
        )
    table = np.loadtxt(DATA_FILE, delimiter=",", dtype=np.int64)
    features = torch.tensor(table[:, :NUM_FEATURES] / MAX_PIXEL, dtype=torch.float32)
    targets = torch.tensor(table[:, NUM_FEATURES], dtype=torch.long)
    eval_idx, train_idx = map(torch.from_numpy, split_rows(len(targets), seed, eval_fraction))
    train_set = NoisyDigits(features[train_idx], targets[train_idx], noise, seed)
    return train_set, TensorDataset(features[eval_idx], targets[eval_idx])


def split_rows(count: int, seed: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(eval, train) row numbers of the data file's `count` rows, in the order of the splits."""
    order = np.random.default_rng(seed).permutation(count)
    num_eval = round(count * eval_fraction)
    return order[:num_eval], order[num_eval:]
