"""Helpers for train.py: config, metrics and trackers, checkpoints, stop signals, platform and hardware."""
