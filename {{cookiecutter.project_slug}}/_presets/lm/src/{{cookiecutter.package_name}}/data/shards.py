"""A folder of token shards, as prepare.py writes it (docs/task.md), read through np.memmap: a window reads
its few tokens from the page cache, so memory stays small whatever the size of the corpus."""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .chars import Chars
from .token_format import DTYPE, FORMAT, META_FILE, TOKENIZER_FILE, DataError, file_sha256

# A memory map's read pages count as the process's resident memory until it is closed, and a read fault
# maps up to ~1.5 MB for a window's 130 bytes: maps reopened every REOPEN_AFTER reads keep that near 100 MB
# (980 MB of a 1 GB corpus after 300 steps otherwise; the template's docs/benchmarks.md).
REOPEN_AFTER = 64
PREPARE = f"python -m {__package__.rsplit('.', 1)[0]}.prepare"  # the command that makes a folder


class BytePairs:
    """A byte-level BPE of the `tokenizers` library, trained by prepare.py and saved in the folder."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.size = self.tokenizer.get_vocab_size()
        line_break = self.tokenizer.encode("\n").ids
        self.line_break = line_break[0] if len(line_break) == 1 else -1
        self.digest = hashlib.sha256(path.read_bytes()).hexdigest()

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text).ids, dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist())


@dataclass(frozen=True)
class Shard:
    path: Path
    tokens: int
    sha256: str = ""  # meta.json's


class TokenShards:
    """The tokens of all shards as one sequence (or its part [start, stop)): slices are int64 tensors. The
    memory maps are opened on first use in each process and never pickled (workers open their own)."""

    def __init__(
        self, shards: list[Shard], start: int = 0, stop: int | None = None, vocabulary: str = ""
    ) -> None:
        self.shards = shards
        self.vocabulary = vocabulary
        self.ends = np.cumsum([shard.tokens for shard in shards]).tolist()
        self.start = start
        self.stop = self.ends[-1] if stop is None else stop
        self._maps: dict[int, np.memmap] = {}
        self._reads = 0

    def __len__(self) -> int:
        return self.stop - self.start

    def part(self, start: int, stop: int) -> TokenShards:
        return TokenShards(self.shards, self.start + start, self.start + stop, self.vocabulary)

    def fingerprint(self) -> dict[str, str]:
        """The vocabulary's and each shard's SHA-256 (as open_shards verified them), and the part read."""
        entries = {"vocabulary": f"sha256 {self.vocabulary}"}
        entries |= {shard.path.name: f"{shard.tokens} tokens, sha256 {shard.sha256}" for shard in self.shards}
        return entries | {"tokens read": f"{self.start} to {self.stop}"}

    def __getitem__(self, where: slice) -> torch.Tensor:
        first, last, _ = where.indices(len(self))
        self._reads += 1
        if self._reads > REOPEN_AFTER:
            self._maps.clear()  # closes them: the ids handed out are copies
            self._reads = 1
        last = self.start + max(first, last)
        first = self.start + first
        pieces = []
        index = bisect.bisect_right(self.ends, first)
        while first < last:
            begin = self.ends[index] - self.shards[index].tokens
            end = min(last, self.ends[index])
            pieces.append(self._map(index)[first - begin : end - begin])
            first = end
            index += 1
        ids = np.concatenate(pieces) if len(pieces) != 1 else pieces[0]
        return torch.from_numpy(ids.astype(np.int64))

    def _map(self, index: int) -> np.memmap:
        if index not in self._maps:
            self._maps[index] = np.memmap(self.shards[index].path, dtype=DTYPE, mode="r")
            self._maps[index].base.madvise(mmap.MADV_RANDOM)
        return self._maps[index]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}


def read_meta(folder: Path) -> dict[str, Any]:
    how = f"make it with {PREPARE} --input FILE... --output {folder}"
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{folder} is no prepared token folder: it has no {META_FILE}; {how}") from None
    except (OSError, ValueError) as error:
        raise DataError(f"{folder / META_FILE} cannot be read ({error}); {how}") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"{folder / META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}; {how}")
    return meta


def open_shards(folder: Path) -> tuple[Any, TokenShards]:
    """The tokenizer and the tokens of a prepared folder. Every shard's size and SHA-256 are checked against
    meta.json (reads every shard once: about a second per GB)."""
    meta = read_meta(folder)
    again = f"prepare the folder again ({PREPARE})"
    shards = []
    for entry in meta["shards"]:
        path = folder / entry["file"]
        size = path.stat().st_size if path.is_file() else None
        expected = entry["tokens"] * DTYPE.itemsize
        if size is None:
            raise DataError(f"shard {path} is missing; {again}")
        if size != expected:
            raise DataError(
                f"shard {path} has {size} bytes, meta.json says {expected}: truncated or replaced; {again}"
            )
        if file_sha256(path) != entry["sha256"]:
            raise DataError(f"shard {path} does not match its checksum in meta.json: damaged; {again}")
        shards.append(Shard(path, entry["tokens"], entry["sha256"]))
    if not shards:
        raise DataError(f"{folder / META_FILE} lists no shards; {again}")
    if meta["tokenizer"] == "char":
        tokenizer: Any = Chars(meta["chars"])
    else:
        tokenizer = BytePairs(folder / TOKENIZER_FILE)
        if tokenizer.digest != meta["tokenizer_sha256"]:
            raise DataError(f"{folder / TOKENIZER_FILE} does not match its checksum in meta.json; {again}")
    return tokenizer, TokenShards(shards, vocabulary=tokenizer.digest)
