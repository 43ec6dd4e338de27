"""The task: all that train.py and predict.py know about the data, the model and the metrics. Images:
classify images stored one folder per class (data/train/<class>/*.png, data/val/<class>/*.png) with a
small CNN. Your own task: docs/own-task.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .fine_tuning import FineTuningConfig
from .utils.config import Check, ConfigError, setting

# torch, Pillow and the data/ and models/ modules are imported inside the functions that use them, so that
# `train.py --help` and config errors answer before torch loads (seconds).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from .data.image_folder import Normalization


@dataclass
class Config(FineTuningConfig):
    # This task's fields (each is a YAML key and a --flag), each with its meaning for --help; those of
    # fine-tuning are FineTuningConfig's. A pretrained_model (e.g. google/vit-base-patch16-224, a transformers
    # image classifier) replaces the CNN, whose `channels` is then unused; image_size must be its own.
    # A relative data_dir is taken from the project root. predict.py also reads the class names
    # (train/'s folder names) from it.
    data_dir: str = setting("data", "the image folder: train/<class>/ and val/<class>/ under it")
    image_size: int = setting(32, "images of another size are scaled and centre-cropped to it")
    crop_padding: int = setting(4, "augmentation: random crops of the image padded by this many pixels")
    flip: bool = setting(True, "augmentation: mirror left to right half of the time")
    channels: int = setting(16, "width of the CNN's first stage (then 2x, 4x)")
    dropout: float = setting(0.1, "dropout before the classifier (a pretrained ViT's: hidden and attention)")
    # TrainConfig's defaults that this task sets otherwise.
    num_epochs: int = 40  # 480 optimizer steps of 64 images
    learning_rate: float = 1e-2
    eval_every: int = 60  # every 5 epochs of 12 steps
    best_metric: str = "eval/accuracy"

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/accuracy": "max", "eval/loss": "min"}
    CHECKS: ClassVar[list[Check]] = [
        *FineTuningConfig.CHECKS,
        ("data_dir", lambda v: v.strip() != "", "a non-empty path"),
        ("image_size", lambda v: v >= 8, ">= 8 (three 2x2 poolings)"),
        ("crop_padding", lambda v: v >= 0, ">= 0 (0 means no random crops)"),
        ("channels", lambda v: v > 0, "> 0"),
        ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    from .data.image_folder import image_folder_splits

    _, train_set, eval_set = image_folder_splits(
        config.data_dir,
        config.image_size,
        config.crop_padding,
        config.flip,
        normalization(config),
    )
    return train_set, eval_set


def normalization(config: Config) -> Normalization | None:
    """A pretrained model's: the mean and std of its image processor, which must make images of image_size."""
    if not config.pretrained_model:
        return None  # the CNN standardizes each image itself
    processor = image_processor(config)
    size = processor.size.get("height", processor.size.get("shortest_edge"))
    if size != config.image_size:
        raise ConfigError(
            f"image_size={config.image_size}, but {config.pretrained_model} takes images of {size} pixels: "
            f"pass --image_size {size}"
        )
    return tuple(processor.image_mean), tuple(processor.image_std)


def image_processor(config: Config) -> object:
    from .models.pretrained import load_processor, transformers

    return load_processor(transformers.AutoImageProcessor, config.pretrained_model)


def collate(samples: list[tuple]) -> list:
    """(image, label) pairs stack into an (images, labels) batch; predict_inputs' paths stay strings."""
    from torch.utils.data import default_collate

    return default_collate(samples)


def classes(config: Config) -> list[str]:
    """The class names: the folder names under <data_dir>/train, sorted."""
    from .data.image_folder import class_names, resolve

    return class_names(resolve(config.data_dir) / "train")


def build_model(config: Config) -> torch.nn.Module:
    """The CNN, or the pretrained classifier with a new head, as it trains (with LoRA if asked for)."""
    if not config.pretrained_model:
        from .models.cnn import build_cnn

        return build_cnn(len(classes(config)), config.channels, config.dropout)
    from .models.pretrained import for_training

    return for_training(build_base(config), config)


def build_base(config: Config) -> torch.nn.Module:
    """The pretrained classifier of pretrained_model, with a new head over the classes."""
    from .models.pretrained import load_pretrained, transformers

    dropout = {"hidden_dropout_prob": config.dropout, "attention_probs_dropout_prob": config.dropout}
    auto = transformers.AutoModelForImageClassification
    return load_pretrained(auto, config.pretrained_model, classes(config), **dropout)


def export(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], folder: Path, config: Config) -> None:
    """The CNN as model.safetensors; a pretrained model as a Hugging Face folder with its image processor,
    which from_pretrained(folder) and pipeline("image-classification", model=folder) read (under LoRA: the
    adapter, and with merge_lora the merged model in folder/merged)."""
    if not config.pretrained_model:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
        return
    from .models.pretrained import save_folder

    save_folder(model, state_dict, folder, image_processor(config), config)


def load_export(folder: Path, config: Config) -> torch.nn.Module:
    """What `export` wrote: the CNN's weights, an adapter on this machine's pretrained_model, or a model."""
    if not config.pretrained_model:
        from safetensors.torch import load_model

        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ConfigError(f"{weights} does not exist: train first (python train.py), or pass --model_dir")
        model = build_model(config)
        load_model(model, weights)
        return model
    from .models.pretrained import load_folder, transformers

    auto = transformers.AutoModelForImageClassification
    return load_folder(auto, folder, lambda: build_base(config))


def classify(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The CNN returns logits; a transformers classifier, an output that holds them."""
    output = model(images)
    return getattr(output, "logits", output)


def loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    import torch.nn.functional as F

    images, labels = batch
    return F.cross_entropy(classify(model, images), labels)


def eval_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    images, labels = batch
    logits = classify(model, images).float()
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),
        "hit": (logits.argmax(dim=-1) == labels).float(),
    }


def metrics(values: dict[str, torch.Tensor], config: Config) -> dict[str, float]:
    return {
        "eval/loss": values["loss"].double().mean().item(),
        "eval/accuracy": values["hit"].sum().item() / values["hit"].numel(),
    }


def predict_inputs(config: Config, path: Path | None) -> list[tuple]:
    """(image, path) items of `path`: one PNG or JPEG file, or a folder of them (at any depth, sorted); or,
    when `path` is None, (image, label, path) items of the eval split. Every image is read here, before any
    prediction, so that a bad file stops all processes alike; a ConfigError names it."""
    from .data.image_folder import image_files, load_image, to_tensor

    if path is None:
        eval_set = build_datasets(config)[1]
        return [(*eval_set[index], str(eval_set.samples[index][0])) for index in range(len(eval_set))]
    if path.is_dir():
        files = image_files(path)
        if not files:
            raise ConfigError(f"{path}: no .png, .jpg or .jpeg images in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"input {path} does not exist: pass an image file or a folder of images")
    normalized = normalization(config)
    return [(to_tensor(load_image(file, config.image_size), normalized), str(file)) for file in files]


def predict(model: torch.nn.Module, batch: list, config: Config) -> list[dict[str, Any]]:
    """The image's path, the predicted class, the true one when known, and the probability of each class."""
    images, *known, paths = batch
    probs = classify(model, images).float().softmax(dim=-1).cpu()
    names = classes(config)
    rows = []
    for index, row in enumerate(probs.tolist()):
        out: dict[str, Any] = {"path": paths[index], "prediction": names[int(probs[index].argmax())]}
        if known:
            out["label"] = names[int(known[0][index])]
        out.update({f"prob_{name}": p for name, p in zip(names, row, strict=True)})
        rows.append(out)
    return rows
