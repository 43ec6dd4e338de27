"""The default example: scikit-learn's handwritten digits (1,797 8x8 images), shipped with the package.

It needs no network, so the project trains anywhere, Kaggle with internet off included.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset, TensorDataset

from ..utils.config import TrainConfig

NUM_FEATURES = 64
NUM_CLASSES = 10


def build_datasets(config: TrainConfig) -> tuple[Dataset, Dataset]:
    """Return (train, eval) datasets of (features, label) pairs.

    The split depends only on `config.seed`, so every process and every platform sees the same one.
    """
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(config.seed).permutation(len(labels))
    num_eval = round(len(labels) * config.eval_fraction)
    features = torch.tensor(images / 16.0, dtype=torch.float32)  # pixel values are 0..16
    targets = torch.tensor(labels, dtype=torch.long)
    eval_idx, train_idx = torch.from_numpy(order[:num_eval]), torch.from_numpy(order[num_eval:])
    return (
        TensorDataset(features[train_idx], targets[train_idx]),
        TensorDataset(features[eval_idx], targets[eval_idx]),
    )
