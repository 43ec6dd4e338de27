"""A plain text file as a character-level corpus: its vocabulary (its sorted characters, rebuilt from the
file by every process; the model keeps only its SHA-256), the train/eval split and the windows, which read
token shards (data/shards.py) alike. docs/task.md, "Your own text"."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .token_format import char_ids


class Chars:
    """The character tokenizer: character i of `chars` (sorted by code point) has id i."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.size = len(chars)
        self.line_break = chars.find("\n")  # -1 where the text has no line breaks
        self.digest = hashlib.sha256(chars.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> torch.Tensor:
        """The ids of `text`; ValueError naming the first character that is not in the vocabulary."""
        return torch.from_numpy(char_ids(self.chars, text).astype(np.int64))

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass(frozen=True)
class Corpus:
    tokenizer: Any  # Chars, or shards.BytePairs for a folder prepared with --tokenizer bpe
    ids: Any  # the whole text as ids: an int64 tensor, or shards.TokenShards read through np.memmap


@functools.lru_cache(maxsize=4)
def load_corpus(path: Path) -> Corpus:
    """The file's vocabulary and ids, read once per process (train.py and predict.py ask several times)."""
    text = path.read_text(encoding="utf-8")
    chars = Chars("".join(sorted(set(text))))
    return Corpus(chars, chars.encode(text))


def split_ids(ids: Any, eval_fraction: float) -> tuple[Any, Any]:
    """The first (1 - eval_fraction) of `ids` (a tensor, or token shards) for training, the rest to evaluate:
    a held-out stretch, not scattered lines that share scenes with the training text (as nanoGPT does)."""
    cut = int(len(ids) * (1 - eval_fraction))
    if isinstance(ids, torch.Tensor):
        return ids[:cut], ids[cut:]
    return ids.part(0, cut), ids.part(cut, len(ids))


class TrainWindows(Dataset):
    """Windows of block_size + 1 characters (inputs and next-character targets) that tile the training
    text, shifted each epoch by an offset in [0, block_size) drawn from (seed, epoch) (docs/task.md)."""

    def __init__(self, ids: torch.Tensor, block_size: int, seed: int) -> None:
        self.ids = ids
        self.block_size = block_size
        self.seed = seed
        self.sampler = WindowOrder(len(self), seed)  # the order train.py's loader takes the windows in
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.offset = int(np.random.default_rng([self.seed, epoch]).integers(self.block_size))
        # The order too, here: Accelerate 1.6 does not pass set_epoch on to a sampler of the task's own (a
        # resumed run then took its first epoch in epoch 0's order; .ci/lowest found it).
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        # The last window of the largest offset still ends inside the text.
        return max(0, (len(self.ids) - 1) // self.block_size - 1)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.block_size + self.offset
        return self.ids[start : start + self.block_size + 1]


class EvalWindows(Dataset):
    """Fixed, non-overlapping windows of block_size + 1 characters of the eval text: at most `max_windows`
    of them (0 = all), evenly spaced over it, so that an evaluation stays short but covers the whole text."""

    def __init__(self, ids: torch.Tensor, block_size: int, max_windows: int) -> None:
        self.ids = ids
        self.size = block_size + 1
        available = len(ids) // self.size
        count = min(available, max_windows) if max_windows else available
        self.starts = [k * available // count * self.size for k in range(count)] if count else []

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[self.starts[index] : self.starts[index] + self.size]


class WindowOrder(Sampler[int]):
    """The windows of an epoch in a random order drawn from (seed, epoch), in memory that does not grow with
    the corpus: index i is a keyed permutation of i (a 4-round Feistel network on the smallest even number
    of bits that holds `size`, again while out of range). Accelerate's sampler holds
    torch.randperm(size).tolist(), 4 GB at 100 million windows. Indices are made CHUNK at a time."""

    CHUNK = 4096

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        keys = np.random.default_rng([self.seed, self.epoch]).integers(1 << 31, size=4, dtype=np.uint64)
        for start in range(0, self.size, self.CHUNK):
            chunk = np.arange(start, min(start + self.CHUNK, self.size), dtype=np.uint64)
            yield from self.permute(chunk, keys)

    def permute(self, values: np.ndarray, keys: np.ndarray) -> list[int]:
        mask = np.uint64((1 << self.half) - 1)
        out = self.rounds(values, keys, mask)
        while (outside := out >= self.size).any():  # cycle-walking: at most 4x the domain, so few passes
            out[outside] = self.rounds(out[outside], keys, mask)
        return out.tolist()

    def rounds(self, values: np.ndarray, keys: np.ndarray, mask: np.uint64) -> np.ndarray:
        left, right = values >> np.uint64(self.half), values & mask
        for key in keys:
            mixed = (right * np.uint64(0x9E3779B1) + key) & np.uint64(0xFFFFFFFF)
            mixed = ((mixed ^ (mixed >> np.uint64(15))) * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
            left, right = right, left ^ (mixed & mask)
        return (left << np.uint64(self.half)) | right
