"""A small multilayer perceptron with dropout: replace it with your own network; task.py builds it."""

from __future__ import annotations

from torch import nn


def build_mlp(num_features: int, num_classes: int, hidden_size: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(num_features, hidden_size),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(hidden_size, hidden_size),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(hidden_size, num_classes),
    )
