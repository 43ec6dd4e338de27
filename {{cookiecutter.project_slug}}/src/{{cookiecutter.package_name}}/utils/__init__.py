"""Helpers for train.py: configuration, metrics logging and checkpoints."""
