"""Images in the class-per-folder layout (as torchvision's ImageFolder reads it): <root>/<class>/<image>.

    data/train/circle/000.png, data/train/ring/000.png, ...   (PNG or JPEG, any size, any colour mode)
    data/val/circle/000.png, ...                              (the same class folders)

Class k is the k-th class folder in sorted order. Images are read with Pillow as RGB, brought to
image_size x image_size (scaled and centre-cropped, only if they are not that size already) and scaled to
[-1, 1] (or normalized as a pretrained model's image processor does)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..utils.config import ConfigError
from ..utils.machine.packages import require

# At import, so that a missing package stops train.py and predict.py before they write anything. The
# package itself first: if it is missing, that is what the message names.
PILLOW = "pillow>=9"
require("PIL", PILLOW)
Image = require("PIL.Image", PILLOW)
ImageOps = require("PIL.ImageOps", PILLOW)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# The project root (src/<package>/data/ is three levels below it): relative data folders are found from
# there, so train.py, predict.py and the tests work from any working directory.
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def resolve(folder: str) -> Path:
    """`folder` as an absolute path: ~ and $VARS expanded, a relative path taken from the project root."""
    path = Path(os.path.expandvars(os.path.expanduser(folder)))
    return path if path.is_absolute() else PROJECT_ROOT / path


def class_names(root: Path) -> list[str]:
    """The class folders of `root`, sorted: their positions are the labels."""
    if not root.is_dir():
        raise ConfigError(f"image folder {root} does not exist: it needs one subfolder of images per class")
    names = sorted(path.name for path in root.iterdir() if path.is_dir() and not path.name.startswith("."))
    if not names:
        raise ConfigError(f"image folder {root} has no class subfolders (<class>/<image>.png)")
    return names


def image_files(folder: Path) -> list[Path]:
    """The PNG and JPEG files under `folder`, at any depth, sorted by path."""
    return sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES)


def list_samples(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(image, label) for every image under `root`/<class>/; `classes` (the training set's) are required."""
    found = class_names(root)
    if found != classes:
        raise ConfigError(f"{root} has class folders {found}, expected the training set's {classes}")
    samples = []
    for label, name in enumerate(classes):
        files = image_files(root / name)
        if not files:
            raise ConfigError(f"class folder {root / name} has no {'/'.join(IMAGE_SUFFIXES)} images")
        samples += [(path, label) for path in files]
    return samples


def load_image(path: Path, size: int) -> np.ndarray:
    """The image at `path` as a size x size x 3 uint8 array; a ConfigError names a file that is not one."""
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ConfigError(f"{path}: not a readable PNG or JPEG image ({error})") from None
    if image.size != (size, size):
        image = ImageOps.fit(image, (size, size))  # scale the shorter side to `size`, crop the centre
    return np.array(image)  # a copy: torch wants a writable array


# The mean and standard deviation per channel that a pretrained model's image processor normalizes with.
Normalization = tuple[tuple[float, ...], tuple[float, ...]]


def to_tensor(image: np.ndarray, normalization: Normalization | None = None) -> torch.Tensor:
    """A height x width x 3 uint8 image as the model's input: 3 x height x width, scaled to [-1, 1], or
    normalized as a pretrained model's image processor does ((pixel / 255 - mean) / std)."""
    pixels = torch.from_numpy(image).permute(2, 0, 1).float()
    if normalization is None:
        return pixels / 127.5 - 1.0
    mean, std = (torch.tensor(values).view(3, 1, 1) for values in normalization)
    return (pixels / 255 - mean) / std


def augment(image: np.ndarray, padding: int, flip: bool) -> np.ndarray:
    """A random crop of the image padded by `padding` (edge pixels repeated); with `flip`, mirrored left to
    right with probability 1/2. Drawn from numpy's global generator, which the loader seeds from (seed,
    epoch, index) for each training image (training/seeding.py): a resumed run sees the crops it would."""
    top, left = np.random.randint(0, 2 * padding + 1, size=2)
    height, width = image.shape[:2]
    # Indices clipped to the image: the same pixels as a crop of the edge-padded image, without padding it.
    rows = np.clip(np.arange(height) + top - padding, 0, height - 1)
    columns = np.clip(np.arange(width) + left - padding, 0, width - 1)
    if flip and np.random.random() < 0.5:
        columns = columns[::-1]
    return image.take(rows, axis=0).take(columns, axis=1)


class ImageFolder(Dataset):
    """(image, label) pairs of a list of samples, each read when asked for: nothing is held in memory.

    Training images are augmented (`augment`) with `padding` > 0 or `flip`."""

    def __init__(
        self,
        samples: list[tuple[Path, int]],
        size: int,
        padding: int = 0,
        flip: bool = False,
        normalization: Normalization | None = None,
    ) -> None:
        self.samples = samples
        self.size = size
        self.padding = padding
        self.flip = flip
        self.normalization = normalization

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        image = load_image(path, self.size)
        if self.padding or self.flip:
            image = augment(image, self.padding, self.flip)
        return to_tensor(image, self.normalization), label


def image_folder_splits(
    data_dir: str, size: int, padding: int, flip: bool, normalization: Normalization | None = None
) -> tuple[list[str], ImageFolder, ImageFolder]:
    """(class names, train set, eval set) from `data_dir`/train and `data_dir`/val; only the training
    images are augmented."""
    root = resolve(data_dir)
    classes = class_names(root / "train")
    train_set = ImageFolder(list_samples(root / "train", classes), size, padding, flip, normalization)
    eval_set = ImageFolder(list_samples(root / "val", classes), size, normalization=normalization)
    return classes, train_set, eval_set
