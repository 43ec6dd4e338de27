"""torch.compile's work kept in each checkpoint (`compile: true`, docs/resume.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CACHE_FILE = "compile_cache.bin"
ARTIFACTS = hasattr(torch.compiler, "save_cache_artifacts")  # torch 2.7 and later


def made_for(device: torch.device) -> dict[str, str]:
    """What compiled kernels depend on beyond the model: the torch, the device kind, the CUDA build."""
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"torch": torch.__version__, "device": kind, "cuda": torch.version.cuda or ""}


def cache_files(accelerator: Any, config: Any) -> dict[str, bytes]:
    """For the checkpoint (main process): everything compiled so far in this session, loaded or new."""
    saving = config.compile and accelerator.is_main_process and ARTIFACTS
    saved = torch.compiler.save_cache_artifacts() if saving else None  # None before anything was compiled
    if saved is None:
        return {}
    return {CACHE_FILE: json.dumps(made_for(accelerator.device)).encode() + b"\n" + saved[0]}


def load_cache(config: Any, device: torch.device, checkpoint: Path | None) -> str:
    """Load the checkpoint's compile cache if made for this torch and device; the history's line about it."""
    if not config.compile or checkpoint is None:
        return ""
    scratch = "this session compiles from scratch"
    if not ARTIFACTS:
        return f"compile cache: torch {torch.__version__} keeps none with a run (2.7 and later do): {scratch}"
    name = f"compile cache of {checkpoint.name}"
    if not (checkpoint / CACHE_FILE).is_file():
        return f"{name}: none (saved without compile, or by torch before 2.7): {scratch}"
    header, _, artifacts = (checkpoint / CACHE_FILE).read_bytes().partition(b"\n")
    saved = json.loads(header)
    here = made_for(device)
    if saved != here:
        other = ", ".join(f"{key} {saved.get(key) or 'none'}" for key in here)
        now = ", ".join(f"{key} {here[key] or 'none'}" for key in here)
        return f"{name} not used: made for {other}; here {now}: {scratch}"
    if torch.compiler.load_cache_artifacts(artifacts) is None:
        return f"{name} not used: torch could not read it: {scratch}"
    return f"{name} loaded ({len(artifacts) / 1e6:.1f} MB, made for torch {here['torch']}, {here['device']})"
