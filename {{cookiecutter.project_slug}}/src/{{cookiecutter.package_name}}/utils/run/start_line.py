"""The lines a run starts with: where and how it runs, and the model's size (docs/outputs.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..machine.hardware import detect_platform


def start_line(accelerator: Any, config: Any, config_path: str, precision_why: str, threads: str) -> str:
    """The run's start line: where it runs, on what, in which precision and batches."""
    processes = accelerator.num_processes
    deterministic = "on" if config.deterministic else "off"
    accumulation = accelerator.gradient_accumulation_steps
    batch = f"{config.per_device_batch_size} x {processes} processes x {accumulation} accumulation"
    if config.auto_batch_size:
        batch = f"up to {config.per_device_batch_size} (auto_batch_size, below) x {processes} processes"
    return (
        f"platform {detect_platform()} | config {config_path} | world size {processes} | "
        f"distributed {accelerator.distributed_type.value} | device {accelerator.device} | "
        f"mixed precision {accelerator.mixed_precision} ({precision_why}) | per-device batch {batch} = "
        f"global batch {config.global_batch_size} | deterministic kernels {deterministic} | "
        f"CPU threads {threads} | output {Path(config.output_dir)}"
    )


def model_line(model: Any) -> str:
    """`model: 1.2M parameters, 12.3K trainable; a checkpoint holds about 150.2KB` (weights, Adam moments)."""
    params = list(model.parameters())
    trained = [param for param in params if param.requires_grad]
    size = 3 * sum(param.nbytes for param in trained)
    shown = []
    for value in (sum(param.numel() for param in params), sum(param.numel() for param in trained), size):
        power = min(4, (len(str(value)) - 1) // 3)
        shown.append(f"{value / 1000**power:.1f}{' KMGT'[power]}" if power else str(value))
    return f"model: {shown[0]} parameters, {shown[1]} trainable; a checkpoint holds about {shown[2]}B"
