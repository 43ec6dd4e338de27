"""The data fingerprint (utils/run/fingerprint.py) of map-style datasets, which a resume compares with its
checkpoint's (the refusals themselves: the text preset's test_streams.py and the lm preset's test_shards.py):

- the task's own datasets, built twice, have one fingerprint: a resume on unchanged data is never refused;
  so do samples augmented from the global generators (each made as the train loader makes it);
- in-memory tensors (a TensorDataset), samples read one by one (a dataset of lists) and files named by a
  dataset's attributes (an image folder's (path, label) list): a changed value, an added file and a removed
  file are each the first difference, named; the same files in another folder (another platform's path
  to them) keep the fingerprint.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.utils.run.fingerprint import (
    data_fingerprint,
    first_difference,
    plain_state,
)


class Texts(Dataset):
    """Samples held in lists, read one by one."""

    def __init__(self, texts: list[str], labels: list[int]) -> None:
        self.texts, self.labels = texts, labels

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict:
        return {"text": self.texts[index], "label": torch.tensor(self.labels[index])}


class Files(Dataset):
    """(path, label) pairs, as an image folder lists them."""

    def __init__(self, samples: list[tuple[Path, int]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> bytes:
        return self.samples[index][0].read_bytes()


def test_the_tasks_datasets_have_one_fingerprint() -> None:
    config = task.Config()
    first = data_fingerprint(*task.build_datasets(config))
    again = data_fingerprint(*task.build_datasets(config))
    assert first and first == again
    assert {name.split(" ")[0] for name in first} == {"train", "eval"}


class Augmented(Dataset):
    """Samples jittered from numpy's and Python's global generators as they are read, through a transform
    held as an attribute (not a plain value: the fingerprint hashes the samples)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.transform = rows, lambda row: row * np.random.uniform(0.5, 1.5) + random.gauss(0, 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(self.rows[index])


def test_samples_augmented_from_the_global_generators_have_one_fingerprint() -> None:
    """Each sample is made as the train loader makes it, its generators seeded from its index: the same
    fingerprint at every call, whatever the generators held before; changed data is still a difference."""
    rows = torch.rand(40, 3, generator=torch.Generator().manual_seed(0))
    first = data_fingerprint(Augmented(rows), Augmented(rows[:4]))
    np.random.seed(1)
    random.seed(1)
    assert data_fingerprint(Augmented(rows), Augmented(rows[:4])) == first
    assert first_difference(first, data_fingerprint(Augmented(rows + 1), Augmented(rows[:4]))).startswith(
        "train samples differs (40 samples, xxh3 "
    )


def test_in_memory_data_changed_is_the_first_difference() -> None:
    features, labels = torch.rand(50, 8, generator=torch.Generator().manual_seed(0)), torch.arange(50) % 3
    saved = data_fingerprint(TensorDataset(features, labels), Texts(["a", "b"], [0, 1]))
    assert plain_state(TensorDataset(features, labels))  # hashed whole, not sample by sample
    assert not plain_state(Texts(["a", "b"], [0, 1]))  # lists without tensors: sample by sample
    edited = features.clone()
    edited[49, 7] += 1
    now = data_fingerprint(TensorDataset(edited, labels), Texts(["a", "b"], [0, 1]))
    assert first_difference(saved, now).startswith("train samples differs (50 samples, xxh3 ")
    now = data_fingerprint(TensorDataset(features, labels), Texts(["a", "c"], [0, 1]))
    assert first_difference(saved, now).startswith("eval samples differs (2 samples, xxh3 ")
    now = data_fingerprint(TensorDataset(features.clone(), labels.clone()), Texts(["a", "b"], [0, 1]))
    assert first_difference(saved, now) is None


def test_files_are_named_when_changed_added_or_removed_and_not_by_their_folder(tmp_path: Path) -> None:
    for name in ("cat/1.png", "cat/2.png", "dog/1.png", "dog/3.png"):
        (tmp_path / "a" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "a" / name).write_bytes(name.encode())
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    def fingerprint(root: Path) -> dict[str, str]:
        files = sorted(root.rglob("*.png"))
        return data_fingerprint(Files([(path, 0) for path in files]), Files(files[:1]))

    saved = fingerprint(tmp_path / "a")
    names = ["train cat/1.png", "train cat/2.png", "train dog/1.png", "train dog/3.png", "eval 1.png"]
    assert list(saved) == names
    assert fingerprint(tmp_path / "b") == saved  # the same files elsewhere: a hop keeps the fingerprint
    (tmp_path / "b" / "cat" / "2.png").write_bytes(b"cat/2.pnG")  # same size
    assert first_difference(saved, fingerprint(tmp_path / "b")).startswith("train cat/2.png differs (9 bytes")
    (tmp_path / "b" / "cat" / "2.png").write_bytes(b"cat/2.png")
    (tmp_path / "b" / "dog" / "2.png").write_bytes(b"new")
    assert first_difference(saved, fingerprint(tmp_path / "b")) == (
        f"train dog/2.png was added ({fingerprint(tmp_path / 'b')['train dog/2.png']})"
    )
    (tmp_path / "b" / "dog" / "2.png").unlink()
    (tmp_path / "b" / "dog" / "1.png").unlink()  # dog/3.png stays: the files still share the folder b/
    assert first_difference(saved, fingerprint(tmp_path / "b")).startswith("train dog/1.png was removed")
