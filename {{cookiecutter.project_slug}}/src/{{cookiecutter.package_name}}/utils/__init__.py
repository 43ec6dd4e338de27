"""Helpers for train.py: config, metrics and trackers, checkpoints, stop signals, platform and hardware,
optional packages, and workarounds for Accelerate's per-step costs."""

import warnings

# peft reads a name transformers 5 renamed: a FutureWarning at every get_peft_model, from a preset's LoRA
# or a user's own task.py alike, that is neither's to fix (task.py imports this package first).
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
