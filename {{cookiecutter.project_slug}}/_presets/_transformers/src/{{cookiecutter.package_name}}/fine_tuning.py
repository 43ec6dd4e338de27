"""The config fields of fine-tuning a pretrained Hugging Face model, shared by the presets built on
transformers: their task.py's `Config` adds its own fields to these. What they do: models/pretrained.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .utils.config import Check, TrainConfig, session, setting


@dataclass
class FineTuningConfig(TrainConfig):
    # It may name another folder in another session (a copy on Kaggle of what was on Drive): a resume
    # checks the frozen weights themselves, not their name.
    pretrained_model: str = session(
        "", "a Hugging Face Hub name or local folder to fine-tune (empty: the small model built here)"
    )
    # Under LoRA, checkpoints hold the adapter, the new head and their optimizer state, not the base.
    lora_rank: int = setting(0, "LoRA adapters of this rank, every weight but theirs and the head's frozen")
    lora_alpha: float = setting(16.0, "LoRA's scale: an adapter adds lora_alpha / lora_rank x its product")
    lora_dropout: float = setting(0.0, "dropout on the input of LoRA's adapters")
    lora_target_modules: str = setting(
        "", "comma-separated names of the modules that get adapters ('': the default for the model family)"
    )
    # How activations are kept and what is exported change neither the optimization nor its numbers.
    merge_lora: bool = session(False, "LoRA: also export <model>/merged, the base with the adapter added in")
    gradient_checkpointing: bool = session(
        False, "recompute activations in the backward pass: less memory, about a third more compute"
    )

    CHECKS: ClassVar[list[Check]] = [
        *TrainConfig.CHECKS,
        ("lora_rank", lambda v: v >= 0, ">= 0 (0: no LoRA)"),
        ("lora_alpha", lambda v: v > 0, "> 0"),
        ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]
