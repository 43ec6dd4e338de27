"""Datasets. `train.py` only calls `build_datasets`: replace it to train on your own data."""

from .digits import build_datasets

__all__ = ["build_datasets"]
