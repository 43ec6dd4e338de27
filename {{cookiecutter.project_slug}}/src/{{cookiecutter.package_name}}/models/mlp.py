"""The default example's model: a small multilayer perceptron with dropout."""

from __future__ import annotations

from torch import nn

from ..data.digits import NUM_CLASSES, NUM_FEATURES
from ..utils.config import TrainConfig


def build_model(config: TrainConfig) -> nn.Module:
    """An MLP sized by `config.hidden_size`; the exported weights load back into `build_model(config)`."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, config.hidden_size),
        nn.GELU(),
        nn.Dropout(config.dropout),
        nn.Linear(config.hidden_size, config.hidden_size),
        nn.GELU(),
        nn.Dropout(config.dropout),
        nn.Linear(config.hidden_size, NUM_CLASSES),
    )
