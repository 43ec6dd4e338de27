"""The task: all that train.py and predict.py know about the data, the model and the metrics.

Images: classify images stored one folder per class (data/train/<class>/*.png, data/val/<class>/*.png)
with a small CNN. To train your own task, change this file and the data/ and models/ modules it calls;
train.py and predict.py stay as they are, and so do exact resume, the same optimization on any number of
processes and exact distributed evaluation.

The contract (README, "Bring your own task"); every run checks it on two samples before it starts, and
`python train.py --check_task` checks it alone:
- `Config`: the run's config, TrainConfig's fields plus this task's, with its checks and its metrics
  (METRIC_GOALS: "max" or "min" for each).
- `build_datasets(config)`: (train, eval) map-style datasets. A train set with `set_epoch(epoch)` has
  it called before each epoch (maybe more than once): randomness in an item must be a function of
  (seed, epoch, index). A wrapper around such a set (Subset, ConcatDataset) needs a `set_epoch` that
  calls the wrapped set's, or the augmentation repeats every epoch.
- `collate(samples)`: a batch: a tensor, a tuple/list or a mapping (dict, BatchEncoding) of tensors,
  each with one row per sample (train.py cuts micro-batches along that first dimension).
- `build_model(config)`: the network; the exported weights load back into `build_model(config)`.
- `loss(model, batch)`: the batch's mean loss, a scalar tensor. A batch padded to its longest sample
  drops the columns that are padding in every row of the micro-batch it gets: 1 and N processes then
  compute on the same shapes.
- `eval_step(model, batch)`: named tensors with one value per sample (shape [batch size]). train.py
  gathers them from all processes, in dataset order, without the padding of the last uneven batch.
  Each value is computed inside its batch: where a model's output for a row depends on the batch's size
  (kernels chosen by shape), 1 and N processes agree up to rounding, not bit for bit.
- `metrics(values, config)`: the eval metrics from those values over the whole eval set, reduced once;
  `config` carries this task's fields (weights, thresholds).
- `predict_inputs(config, path)`: what predict.py predicts: a dataset read from `path`, or the eval
  split (with its labels) when `path` is None.
- `predict(model, batch, config)`: one row (column -> value) per sample of a batch of predict_inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .utils.config import Check, ConfigError, TrainConfig, setting

# torch, Pillow and the data/ and models/ modules are imported inside the functions that use them, so that
# `train.py --help` and config errors answer before torch loads (seconds).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset


@dataclass
class Config(TrainConfig):
    # This task's fields (each is a YAML key and a --flag), each with its meaning for --help.
    # A relative data_dir is taken from the project root. predict.py also reads the class names
    # (train/'s folder names) from it.
    data_dir: str = setting("data", "the image folder: train/<class>/ and val/<class>/ under it")
    image_size: int = setting(32, "images of another size are scaled and centre-cropped to it")
    crop_padding: int = setting(4, "augmentation: random crops of the image padded by this many pixels")
    flip: bool = setting(True, "augmentation: mirror left to right half of the time")
    channels: int = setting(16, "width of the CNN's first stage (then 2x, 4x)")
    dropout: float = setting(0.1, "dropout before the classifier")
    # TrainConfig's defaults that this task sets otherwise.
    num_epochs: int = 40  # 480 optimizer steps of 64 images
    learning_rate: float = 1e-2
    eval_every: int = 60  # every 5 epochs of 12 steps
    best_metric: str = "eval/accuracy"

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/accuracy": "max", "eval/loss": "min"}
    CHECKS: ClassVar[list[Check]] = [
        *TrainConfig.CHECKS,
        ("data_dir", lambda v: v.strip() != "", "a non-empty path"),
        ("image_size", lambda v: v >= 8, ">= 8 (three 2x2 poolings)"),
        ("crop_padding", lambda v: v >= 0, ">= 0 (0 means no random crops)"),
        ("channels", lambda v: v > 0, "> 0"),
        ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    from .data.image_folder import image_folder_splits

    _, train_set, eval_set = image_folder_splits(
        config.data_dir, config.image_size, config.crop_padding, config.flip, config.seed
    )
    return train_set, eval_set


def collate(samples: list[tuple]) -> list:
    """(image, label) pairs stack into an (images, labels) batch; predict_inputs' paths stay strings."""
    from torch.utils.data import default_collate

    return default_collate(samples)


def classes(config: Config) -> list[str]:
    """The class names: the folder names under <data_dir>/train, sorted."""
    from .data.image_folder import class_names, resolve

    return class_names(resolve(config.data_dir) / "train")


def build_model(config: Config) -> torch.nn.Module:
    from .models.cnn import build_cnn

    return build_cnn(len(classes(config)), config.channels, config.dropout)


def loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    import torch.nn.functional as F

    images, labels = batch
    return F.cross_entropy(model(images), labels)


def eval_step(model: torch.nn.Module, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    images, labels = batch
    logits = model(images).float()
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
    """(image, path) items of `path`: one PNG or JPEG file, or a folder of them (at any depth, sorted by
    path); or, when `path` is None, (image, label, path) items of the eval split.

    Every image is read here, before any prediction, so that a bad file stops all processes alike; a
    ConfigError names it.
    """
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
    return [(to_tensor(load_image(file, config.image_size)), str(file)) for file in files]


def predict(model: torch.nn.Module, batch: list, config: Config) -> list[dict[str, Any]]:
    """The image's path, the predicted class, the true one when known, and the probability of each class."""
    images, *known, paths = batch
    probs = model(images).float().softmax(dim=-1).cpu()
    names = classes(config)
    rows = []
    for index, row in enumerate(probs.tolist()):
        out: dict[str, Any] = {"path": paths[index], "prediction": names[int(probs[index].argmax())]}
        if known:
            out["label"] = names[int(known[0][index])]
        out.update({f"prob_{name}": p for name, p in zip(names, row, strict=True)})
        rows.append(out)
    return rows
