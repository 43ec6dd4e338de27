"""Decisions that depend on the hardware the run landed on."""

from __future__ import annotations

import os
import warnings

import torch


def detect_platform() -> str:
    """`colab`, `kaggle`, `slurm` or `local`, from the environment each platform sets."""
    if "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        return "kaggle"
    if "SLURM_JOB_ID" in os.environ:
        return "slurm"
    return "local"


def cuda_usable() -> bool:
    # `ACCELERATE_USE_CPU=1` (or `--cpu`) forces a CPU run even where a GPU is present.
    forced_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return torch.cuda.is_available() and not forced_cpu


def resolve_mixed_precision(choice: str) -> str:
    """Turn the config's `mixed_precision` into what Accelerate should use here.

    `auto`: bf16 where the GPU computes it natively (compute capability 8.0+: A100, L4, RTX 30xx),
    fp16 on older GPUs (T4, V100, P100), no mixed precision on the CPU. fp16 asked for on a CPU
    would silently run in fp32, so it is turned off here with a warning instead.
    """
    if not cuda_usable():
        if choice == "fp16":
            warnings.warn("mixed_precision=fp16 needs a GPU; running in fp32 on the CPU", stacklevel=2)
            return "no"
        return "no" if choice == "auto" else choice
    if choice != "auto":
        return choice
    major, _minor = torch.cuda.get_device_capability()
    return "bf16" if major >= 8 else "fp16"
