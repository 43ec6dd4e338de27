"""torch.compile's work kept with the run: a resumed session loads what the last one compiled.

With `compile: true` every checkpoint holds Inductor's cache artifacts (`torch.compiler.save_cache_artifacts`:
its compiled graphs and AOTAutograd's, and on a GPU the Triton kernels and autotuning results) as
`compile_cache.bin`; a resume loads them before the first compiled call, so it does not compile from
scratch (minutes for a large model). In the checkpoint rather than the run folder because a resume starts
from a checkpoint, and checkpoints are what the mirror and `import_from` carry to a new machine, where
Inductor's own disk cache (TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_<user> by default) is gone; they
also checksum and seal it with the rest. The file's first line says what the cache was made for (torch,
device, CUDA): one made for another GPU or torch is not loaded (Inductor could use none of it) and the
history says so in one line. torch before 2.7 has no such artifacts: a resumed compiled session there
compiles from scratch, as before, and the history says that instead. The main process's artifacts are
saved; every process loads them.
"""

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
    """Load the checkpoint's compile cache if it was made for this torch and device, before the first
    compiled call; return the history's line about it ('' without compile or checkpoint)."""
    if not config.compile or checkpoint is None:
        return ""
    scratch, path = "this session compiles from scratch", checkpoint / CACHE_FILE
    if not ARTIFACTS:
        return f"compile cache: torch {torch.__version__} keeps none with a run (2.7 and later do): {scratch}"
    name = f"compile cache of {checkpoint.name}"
    if not path.is_file():
        return f"{name}: none (saved without compile, or by torch before 2.7): {scratch}"
    header, _, artifacts = path.read_bytes().partition(b"\n")
    saved, here = json.loads(header), made_for(device)
    if saved != here:
        other = ", ".join(f"{key} {saved.get(key) or 'none'}" for key in here)
        now = ", ".join(f"{key} {here[key] or 'none'}" for key in here)
        return f"{name} not used: made for {other}; here {now}: {scratch}"
    if torch.compiler.load_cache_artifacts(artifacts) is None:
        return f"{name} not used: torch could not read it: {scratch}"
    return f"{name} loaded ({len(artifacts) / 1e6:.1f} MB, made for torch {here['torch']}, {here['device']})"
