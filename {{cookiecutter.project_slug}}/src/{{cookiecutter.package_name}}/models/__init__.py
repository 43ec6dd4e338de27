"""Models. `train.py` only calls `build_model`: replace it to train your own network."""

from .mlp import build_model

__all__ = ["build_model"]
