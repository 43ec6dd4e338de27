"""What a run trains and evaluates on, as a fingerprint every checkpoint keeps: a resume on other data stops
with one line naming the first entry that differs (docs/resume.md, docs/own-task.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..training.seeding import SeededItems

PLAIN = (str, bytes, int, float, bool, Path)
SAMPLES_AT_ONCE = 1024  # samples asked for at a time, through __getitems__ where the dataset has it


def data_fingerprint(train_set: Any, eval_set: Any) -> dict[str, str]:
    """One entry per file or sample set of both: "<train|eval> <name>" -> its description, in order."""
    return {**describe(train_set, "train"), **describe(eval_set, "eval")}


def first_difference(saved: dict[str, str], now: dict[str, str]) -> str | None:
    """The first entry that differs between two fingerprints, in words; None if they are the same."""
    for name, description in now.items():
        if name not in saved:
            return f"{name} was added ({description})"
        if saved[name] != description:
            return f"{name} differs ({saved[name]} before, {description} now)"
    for name, description in saved.items():
        if name not in now:
            return f"{name} was removed ({description})"
    return None


def describe(dataset: Any, role: str) -> dict[str, str]:
    """The entries of one dataset, each named "<role> <file or part>"."""
    for holder in (dataset, *vars_of(dataset).values()):
        own = getattr(holder, "fingerprint", None)
        if callable(own) and not isinstance(holder, type):
            return {f"{role} {name}": value for name, value in own().items()}
    files = stream_files(dataset) or attribute_files(dataset)
    if files:
        return file_entries(files, role)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return {f"{role} {type(dataset).__name__}": "a stream without local files: not fingerprinted"}
    if state := plain_state(dataset):
        return {f"{role} samples": f"{len(dataset)} samples, xxh3 {values_xxh3(state)}"}
    return {f"{role} samples": samples_description(dataset)}


def vars_of(value: Any) -> dict[str, Any]:
    return dict(getattr(value, "__dict__", {}))  # {} without one (slots, builtins)


def stream_chain(stream: Any) -> Iterator[Any]:
    """The iterables a Hugging Face `datasets` stream is made of, breadth first (its files in their order)."""
    pending = [getattr(stream, "_ex_iterable", None)]
    while pending:
        if (iterable := pending.pop(0)) is not None:
            yield iterable
            pending += [getattr(iterable, "ex_iterable", None), *getattr(iterable, "ex_iterables", [])]


def stream_files(dataset: Any) -> list[Path]:
    """The local files a Hugging Face `datasets` stream reads, or a `datasets.Dataset`'s arrow files."""
    files = []
    for iterable in stream_chain(dataset):
        kwargs = getattr(iterable, "kwargs", None) or {}
        for key in ("original_files", "base_files", "files"):  # the key differs between file formats
            if key in kwargs:
                files += [Path(str(file)) for file in kwargs[key] if os.path.isfile(str(file))]
                break
    for cache in getattr(dataset, "cache_files", None) or []:
        files.append(Path(cache["filename"]))
    return list(dict.fromkeys(files))


def attribute_files(dataset: Any) -> list[Path]:
    """Files named by the dataset's attributes: a Path, or a list of paths or of (path, ...) tuples."""
    files: list[Path] = []
    for value in vars_of(dataset).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            path = item[0] if isinstance(item, (list, tuple)) and item else item
            if isinstance(path, Path) and path.is_file():
                files.append(path)
    return files


def plain_state(dataset: Any) -> dict[str, Any]:
    """The dataset's attributes if each is a tensor, an array, a plain value, or lists of them; else {}."""
    state = vars_of(dataset)
    arrays = False
    for value in state.values():
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(item, (torch.Tensor, np.ndarray, *PLAIN)) or item is None for item in items):
            return {}
        arrays = arrays or any(isinstance(item, (torch.Tensor, np.ndarray)) for item in items)
    return state if arrays else {}


def file_entries(files: list[Path], role: str) -> dict[str, str]:
    """Each file by its name under the folder the files share (the same elsewhere), its size and XXH3-128."""
    paths = [os.path.abspath(file) for file in files]
    root = os.path.commonpath([os.path.dirname(path) for path in paths])
    entries = {}
    for path in paths:
        name = Path(os.path.relpath(path, root)).as_posix()
        entries[f"{role} {name}"] = f"{os.path.getsize(path)} bytes, xxh3 {file_xxh3(Path(path))}"
    return entries


def file_xxh3(path: Path) -> str:
    """The XXH3-128 of a file: a data file's here, and every file's of a checkpoint or an export."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def samples_description(dataset: Any) -> str:
    """The count and one XXH3-128 of every sample's values, in order, each seeded as the train loader does."""
    digest = xxhash.xxh3_128()
    count = len(dataset)
    items = SeededItems(dataset, seed=0)
    for start in range(0, count, SAMPLES_AT_ONCE):
        update(digest, items.__getitems__(list(range(start, min(count, start + SAMPLES_AT_ONCE)))))
    return f"{count} samples, xxh3 {digest.hexdigest()}"


def values_xxh3(value: Any) -> str:
    """One XXH3-128 of tensors, arrays and plain values, in containers: for a dataset's `fingerprint()`."""
    digest = xxhash.xxh3_128()
    update(digest, value)
    return digest.hexdigest()


def update(digest: Any, value: Any) -> None:
    """Hash a sample's values: tensors and arrays by dtype, shape and bytes, containers item by item."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())  # hashed in place, not copied
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).view(np.uint8).reshape(-1))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"key {key}".encode())
            update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)}".encode())
        for item in value:
            update(digest, item)
    elif isinstance(value, PLAIN) or value is None:
        digest.update(f"{type(value).__name__} {value!r}".encode())
    else:  # an object of the task's own: its type only (its repr may hold a memory address)
        digest.update(f"object {type(value).__qualname__}".encode())
