"""Tokenize text, jsonl or parquet files into uint16 token shards for `data_file`, read through np.memmap, in
two streaming passes (the tokenizer, then the ids; docs/task.md, "A corpus larger than memory"):

    python -m {{ cookiecutter.package_name }}.prepare --input "corpus/*.txt" more.jsonl --output data/tokens
    python train.py --data_file data/tokens
"""

from __future__ import annotations

import argparse
import codecs
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .data.token_format import DTYPE, FORMAT, META_FILE, TOKENIZER_FILE, DataError, char_ids, file_sha256
from .utils.training.timing import format_duration

SEPARATOR = "\n\n"  # between two documents
CHUNK_BYTES = 4 << 20  # read and tokenized at a time: the memory of a pass, whatever the corpus
DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB per shard


def main(argv: list[str] | None = None) -> None:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.prepare", description=summary)
    parser.add_argument("--input", nargs="+", required=True, help="text, jsonl or parquet files, or globs")
    parser.add_argument("--output", required=True, help="the new folder of shards (must not exist)")
    parser.add_argument("--tokenizer", choices=("char", "bpe"), default="char", help="default: char")
    parser.add_argument("--vocab_size", type=int, default=4096, help="--tokenizer bpe: its vocabulary size")
    parser.add_argument("--text_field", default="text", help="the text of a jsonl record or parquet row")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    args = parser.parse_args(argv)
    try:
        if not 256 < args.vocab_size <= 2**16:
            raise DataError(f"--vocab_size {args.vocab_size}: between 257 and 65536 (uint16 ids)")
        if args.shard_tokens < 1:
            raise DataError(f"--shard_tokens {args.shard_tokens}: at least 1")
        files = input_files(args.input)
        output = Path(args.output)
        meta = prepare(files, output, args.tokenizer, args.vocab_size, args.text_field, args.shard_tokens)
    except DataError as error:
        sys.exit(f"error: {error}")
    print(
        f"prepared {args.output}: {meta['tokens']:,} tokens in {len(meta['shards'])} shard(s), "
        f"{meta['tokenizer']} tokenizer of {meta['vocab_size']} ids | train: python train.py --data_file "
        f"{args.output}"
    )


def input_files(patterns: list[str]) -> list[Path]:
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern]
        for name in matched:
            path = Path(os.path.expanduser(name))
            if not path.is_file():
                raise DataError(f"--input {name}: no such file")
            files.append(path)
        if not matched:
            raise DataError(f"--input {pattern}: matches no file")
    return files


def prepare(
    files: list[Path], output: Path, tokenizer: str, vocab_size: int, text_field: str, shard_tokens: int
) -> dict[str, Any]:
    """Write the shards and meta.json of `files` to the new folder `output`; returns the metadata."""
    if output.exists():
        raise DataError(f"--output {output} exists; prepare writes a new folder only: name another one")
    total = sum(path.stat().st_size for path in files)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.incomplete-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the shards are a shared data set
    try:
        meta: dict[str, Any] = {"format": FORMAT, "tokenizer": tokenizer, "text_field": text_field}
        with Progress("vocabulary" if tokenizer == "char" else "train bpe", total) as progress:
            pieces = texts(files, text_field, progress.advance)
            to_ids = build_tokenizer(pieces, tokenizer, vocab_size, staging, meta)
        with Progress("tokenize", total) as progress, ShardWriter(staging, shard_tokens) as writer:
            for text in texts(files, text_field, progress.advance):
                writer.write(to_ids(text))
        if not writer.tokens:
            raise DataError(f"the input ({', '.join(map(str, files))}) holds no text")
        meta |= {"tokens": writer.tokens, "shards": writer.entries, "inputs": [str(path) for path in files]}
        (staging / META_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False), encoding="utf-8")
        try:
            os.replace(staging, output)
        except OSError as error:  # another prepare made `output` meanwhile
            raise DataError(f"--output {output} appeared meanwhile ({error.strerror}); kept") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # this run's own, unfinished folder
        raise
    return meta


def build_tokenizer(
    pieces: Iterator[str], tokenizer: str, vocab_size: int, folder: Path, meta: dict[str, Any]
) -> Callable[[str], np.ndarray]:
    """The first pass: the tokenizer of the text, recorded in `meta` (and `folder` for a BPE); returns
    the function from text to ids."""
    if tokenizer == "char":
        chars: set[str] = set()
        for text in pieces:
            chars.update(text)
        if len(chars) > 2**16:
            raise DataError(
                f"the input has {len(chars):,} distinct characters, more than uint16 ids hold (65,536): "
                "use --tokenizer bpe"
            )
        meta["chars"] = vocab = "".join(sorted(chars))
        meta["vocab_size"] = len(vocab)
        return lambda text: char_ids(vocab, text)
    bpe = train_bpe(pieces, vocab_size)
    bpe.save(str(folder / TOKENIZER_FILE))
    meta["tokenizer_sha256"] = file_sha256(folder / TOKENIZER_FILE)
    meta["vocab_size"] = bpe.get_vocab_size()
    return lambda text: np.asarray(bpe.encode(text).ids, dtype=np.uint32)


def texts(files: list[Path], text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    """The text of all documents, in pieces of about CHUNK_BYTES, the documents joined by SEPARATOR.
    Pieces end at a line break where the text has one, so that BPE sees whole words."""
    first = True
    for path in files:
        readers = {".jsonl": jsonl_texts, ".parquet": parquet_texts}
        for text, new_document in readers.get(path.suffix.lower(), plain_text)(path, text_field, advance):
            if new_document and not first:
                text = SEPARATOR + text
            first = False
            yield text


def plain_text(path: Path, _: str, advance: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    carried = ""  # the end of a chunk after its last line break
    offset = 0
    new_document = True
    with path.open("rb") as file:
        while raw := file.read(CHUNK_BYTES):
            text = carried + decode(decoder, raw, path, offset)
            offset += len(raw)
            advance(len(raw))
            cut = text.rfind("\n") + 1 or len(text)  # a whole line, unless a line is longer than a chunk
            carried = text[cut:]
            text = text[:cut]
            if text:
                yield text, new_document
                new_document = False
    if text := carried + decode(decoder, b"", path, offset):
        yield text, new_document


def decode(decoder: codecs.IncrementalDecoder, raw: bytes, path: Path, offset: int) -> str:
    try:
        return decoder.decode(raw, final=not raw)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path}: not UTF-8 text ({error.reason} near byte {offset + error.start}); "
            "give UTF-8 text, jsonl or parquet"
        ) from None


def jsonl_texts(path: Path, field: str, advance: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            advance(len(raw))
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as error:
                raise DataError(f"{path}:{number}: not JSON ({error}); one JSON object per line") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: no text field {field!r}; name it with --text_field")
            yield text, True


def parquet_texts(path: Path, field: str, advance: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install -e '.[data]'") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid and friends: not a parquet file
        raise DataError(f"{path}: not a parquet file ({error})") from None
    if field not in table.schema_arrow.names:
        raise DataError(
            f"{path} has no column {field!r} (its columns: {', '.join(table.schema_arrow.names)}); "
            "name the text column with --text_field"
        )
    size = path.stat().st_size
    rows = max(1, table.metadata.num_rows)
    done = 0
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for row, text in enumerate(batch.column(0).to_pylist(), start=done):
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row} of column {field!r} is {text!r}, not text")
            yield text, True
        advance(size * (done + batch.num_rows) // rows - size * done // rows)
        done += batch.num_rows


def train_bpe(pieces: Iterator[str], vocab_size: int) -> Any:
    """A byte-level BPE (as GPT-2's): any text encodes, no unknown characters."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("--tokenizer bpe needs the tokenizers package: pip install -e '.[data]'") from None

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(pieces, trainer=trainer)
    return bpe


class ShardWriter:
    """Appends ids to shard_000000.bin, shard_000001.bin, ... of `shard_tokens` each (the last shorter)."""

    def __init__(self, folder: Path, shard_tokens: int) -> None:
        self.folder = folder
        self.shard_tokens = shard_tokens
        self.entries: list[dict[str, Any]] = []
        self.tokens = 0
        self.file = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(DTYPE)
        while len(ids):
            if self.file is None:
                name = f"shard_{len(self.entries):06d}.bin"
                self.file = (self.folder / name).open("wb")
                self.entries.append({"file": name, "tokens": 0})
            entry = self.entries[-1]
            take = ids[: self.shard_tokens - entry["tokens"]]
            self.file.write(take.tobytes())
            entry["tokens"] += len(take)
            self.tokens += len(take)
            ids = ids[len(take) :]
            if entry["tokens"] == self.shard_tokens:
                self.close_shard()

    def close_shard(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
            entry = self.entries[-1]
            entry["sha256"] = file_sha256(self.folder / entry["file"])  # read back: what is on disk

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close_shard()


class Progress:
    """A plain line every 10 s and one at the end: the same on a terminal and in a log (a SLURM .out)."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.started = self.next_line = time.monotonic()

    def advance(self, count: int) -> None:
        self.done += count
        if time.monotonic() >= self.next_line and self.done < self.total:
            self.next_line = time.monotonic() + 10
            self.print_line()

    def print_line(self) -> None:
        elapsed = max(1e-9, time.monotonic() - self.started)
        rate = self.done / elapsed
        share = 100 * self.done // max(1, self.total)
        parts = [f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB ({share}%)", f"{rate / 1e6:.1f} MB/s"]
        parts.append(f"elapsed {format_duration(elapsed)}")
        if self.done < self.total and rate > 0:
            parts.append(f"ETA {format_duration((self.total - self.done) / rate)}")
        print(f"prepare: {self.label} " + " | ".join(parts), flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.print_line()


if __name__ == "__main__":
    main()
