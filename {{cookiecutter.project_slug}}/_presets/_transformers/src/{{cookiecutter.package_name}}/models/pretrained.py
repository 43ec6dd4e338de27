"""Fine-tuning a Hugging Face model: pretrained weights from a folder or the Hub, LoRA through peft, gradient
checkpointing, and exports that are Hugging Face folders. Shared by the presets built on transformers.

What train.py makes of it, with nothing here to call: parameters that do not require gradients (the base
model under LoRA) stay out of the optimizer and out of every checkpoint, which holds the adapter, the new
head and their optimizer state; a checkpoint records a hash of those frozen weights, and a resume against
other base weights is refused (utils/run/start.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..fine_tuning import FineTuningConfig
from ..utils.config import ConfigError, save_config
from ..utils.machine.packages import require

transformers = require("transformers", "transformers>=4.46")
# Its bars for loading and writing weights would draw frames into the run's log, between train.py's lines.
transformers.utils.logging.disable_progress_bar()

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

PEFT = "peft>=0.14"
# The new classification head of the common families (BERT, ViT, ConvNeXt, ResNet: classifier; GPT-style
# and Llama-style models: score). Under LoRA it is trained in full: it starts from random weights.
HEADS = ("classifier", "score")
# LoRA's default layers: the attention's query and value projections, under the names the model has
# (transformers 5 renamed ViT's query and value to q_proj and v_proj); for the families without attention,
# the pointwise (linear) layers of ConvNeXt and the convolutions of ResNet. Other models: peft's default
# for their family (GPT-2's c_attn, ...).
ATTENTION_TARGETS = (["q_proj", "v_proj"], ["query", "value"])
FAMILY_TARGETS = {"convnext": ["pwconv1", "pwconv2"], "resnet": ["convolution"]}


UNREACHABLE: set[str] = set()  # the Hub names looked for in the cache alone, the Hub being out of reach


def offline_unless_the_hub_answers(name: str) -> None:
    """For a Hub name, go offline at once (the cache only) when the Hub's host cannot be reached: otherwise
    transformers retries for about a minute before it fails. A local folder needs no network."""
    from huggingface_hub import constants

    if Path(name).expanduser().exists() or constants.HF_HUB_OFFLINE:
        return
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for what reads the variable later
        constants.HF_HUB_OFFLINE = True  # for what read it at import
        UNREACHABLE.add(name)


def load_pretrained(auto_class: Any, name: str, labels: list[str], **settings: Any) -> PreTrainedModel:
    """The checkpoint `name` (a Hub name or a folder saved with save_pretrained) with a new head over
    `labels`; `settings` change fields of its config (those it has: dropout names differ by family)."""
    offline_unless_the_hub_answers(name)
    try:
        config = transformers.AutoConfig.from_pretrained(
            name, id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
        )
        for field, value in settings.items():
            if hasattr(config, field):
                setattr(config, field, value)
        # A head of another size (the checkpoint's own labels) is replaced by a new one, not an error.
        with quiet():
            return auto_class.from_pretrained(name, config=config, ignore_mismatched_sizes=True)
    except OSError as error:
        raise ConfigError(cannot_load(name, error)) from error


def load_processor(auto_class: Any, name: str) -> Any:
    """The tokenizer or image processor saved with the checkpoint `name`."""
    offline_unless_the_hub_answers(name)
    try:
        with quiet():
            return auto_class.from_pretrained(name)
    except OSError as error:
        raise ConfigError(cannot_load(name, error)) from error


def cannot_load(name: str, error: OSError) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if name in UNREACHABLE:
        reason = f"the Hub cannot be reached from here, and it is not in the local cache: {reason}"
    return (
        f"pretrained_model={name!r} could not be loaded ({reason}). A hub checkpoint is downloaded on first "
        "use, which needs the network (then it is cached under ~/.cache/huggingface); offline, pass a local "
        "folder saved with save_pretrained, or leave pretrained_model empty for the model built here"
    )


def for_training(model: PreTrainedModel, config: FineTuningConfig) -> torch.nn.Module:
    """`model` as it is trained: with gradient checkpointing (activations recomputed in the backward pass)
    and, with lora_rank > 0, wrapped once by peft: LoRA adapters on the target modules, the head trained in
    full, every other weight frozen."""
    if config.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            name = type(model).__name__
            raise ConfigError(f"gradient_checkpointing: {name} does not support it; pass false")
        # Non-reentrant: it works when the inputs of a layer need no gradient (a frozen embedding under
        # LoRA), and it replays dropout's random draws, so the result is the same as without it.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_rank == 0:
        return model
    peft = require("peft", PEFT)
    if isinstance(model, peft.PeftModel):  # a second wrap would hide the first adapter from the optimizer
        raise RuntimeError("the model is already wrapped by peft: apply LoRA once, in build_model")
    named = [module.strip() for module in config.lora_target_modules.split(",") if module.strip()]
    targets = named or default_targets(model)
    lora = peft.LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=[head for head in HEADS if hasattr(model, head)],
    )
    try:
        with quiet():
            return peft.get_peft_model(model, lora)
    except ValueError as error:  # no default targets for this family, or a name that matches nothing
        first = str(error).strip().splitlines()[0]
        named_here = f"lora_target_modules={config.lora_target_modules!r}"
        raise ConfigError(
            f"{named_here} for a {model.config.model_type} model: {first}. "
            "Name its attention projections, e.g. --lora_target_modules q_proj,v_proj"
        ) from None


def default_targets(model: PreTrainedModel) -> list[str] | None:
    """The modules LoRA adapts when lora_target_modules is empty (None: peft's default for the family)."""
    if model.config.model_type in FAMILY_TARGETS:
        return FAMILY_TARGETS[model.config.model_type]
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return next((pair for pair in ATTENTION_TARGETS if set(pair) <= names), None)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' errors only: its notes on loading (the new head "MISMATCH", a processor's backend)
    describe what this module asks for on purpose (peft's deprecation warning: utils/__init__.py)."""
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


def save_folder(
    model: torch.nn.Module, state_dict: dict[str, Any], folder: Path, processor: Any, config: FineTuningConfig
) -> None:
    """`model` as a Hugging Face folder, with its tokenizer or image processor: the whole model, or under
    LoRA the adapter in peft's format (PeftModel.from_pretrained(base, folder)), and with merge_lora also
    `folder/merged`, the base with the adapter added in (AutoModel...from_pretrained, pipeline), with the
    run's config.yaml for predict.py."""
    model.save_pretrained(folder, state_dict=state_dict)
    processor.save_pretrained(folder)
    if config.merge_lora and hasattr(model, "merge_and_unload"):
        # A copy: the model may still be training (best_model/ is exported mid-run).
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(folder / "merged")
        processor.save_pretrained(folder / "merged")
        save_config(config, folder / "merged" / "config.yaml")


def load_folder(auto_class: Any, folder: Path, base: Callable[[], PreTrainedModel]) -> torch.nn.Module:
    """The model `save_folder` wrote: an adapter on `base()` (the pretrained model on this machine, which
    need not be where training found it), or a whole model."""
    adapter = (folder / "adapter_config.json").is_file()
    weights = folder / ("adapter_model.safetensors" if adapter else "model.safetensors")
    if not weights.is_file() and not weights.with_name(f"{weights.name}.index.json").is_file():
        raise ConfigError(
            f"{weights} does not exist: train first (python train.py), or pass --model_dir with a folder "
            "train.py exported (<output_dir>/model, <output_dir>/best_model or their merged/)"
        )
    try:
        if adapter:
            peft = require("peft", PEFT)
            with quiet():
                return peft.PeftModel.from_pretrained(base(), folder)
        with quiet():
            return auto_class.from_pretrained(folder)
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"{folder} is not a model folder that train.py exported ({reason}): pass --model_dir "
            "<output_dir>/model, <output_dir>/best_model or their merged/"
        ) from None
