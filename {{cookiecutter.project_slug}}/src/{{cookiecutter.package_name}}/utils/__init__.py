"""Helpers for train.py: config, metrics and trackers, checkpoints, stop signals, platform and hardware,
memory, plots, optional packages, and workarounds for Accelerate's per-step costs."""
