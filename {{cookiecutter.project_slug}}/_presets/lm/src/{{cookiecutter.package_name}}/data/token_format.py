"""The format of a folder of token shards, and the character tokenizer's encoding, without torch: what
prepare.py writes with (it starts in a fraction of a second) and data/shards.py reads with."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
DTYPE = np.dtype("<u2")  # 65,536 ids at most: a character vocabulary or a BPE of up to 64k tokens
FORMAT = "uint16 token shards, version 1"


class DataError(ValueError):
    """Data that cannot be prepared or trained from: the message names the file and what to do."""


def char_ids(vocab: str, text: str) -> np.ndarray:
    """The ids of `text` in `vocab` (its characters, sorted), as int32; ValueError naming the first
    character that is not in `vocab`."""
    table = lookup_table(vocab)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = table[np.minimum(codes, len(table) - 1)]
    if (ids < 0).any() or (len(codes) and codes.max() >= len(table)):
        column = int(np.argmax((ids < 0) | (codes >= len(table))))
        raise ValueError(f"character {text[column]!r} (column {column + 1}) is not in the vocabulary")
    return ids


@functools.lru_cache(maxsize=8)
def lookup_table(vocab: str) -> np.ndarray:
    """id by code point, -1 for characters outside `vocab`: one array index per character."""
    codes = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    table = np.full(int(codes.max()) + 2 if len(codes) else 1, -1, dtype=np.int32)
    table[codes] = np.arange(len(codes), dtype=np.int32)
    return table


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
