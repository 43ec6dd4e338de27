"""Labeled texts streamed from local parquet, csv or jsonl files (`data_files`), through Hugging Face
`datasets` with `streaming=True`: nothing is held in memory but the eval split and the vocabulary.

One pass at start (`scan`) counts the training texts' words and finds the labels and the eval split; the
training stream (`train_stream`) then reads the files again each epoch. The eval split is the texts whose
hash falls under `eval_fraction`: fixed by the texts alone, the same in every process and every pass.
Order: `datasets` interleaves the files row by row, in an order drawn from `seed` and the epoch; rows keep
their order inside a file. The loader then shuffles the rows in windows of `shuffle_window`
(training/streams.py, which refuses a `datasets` shuffle buffer): for a wider mix, write each file's rows in
random order."""

from __future__ import annotations

import csv
import functools
import glob
import json
import logging
import os
import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..utils.config import ConfigError
from ..utils.machine.packages import require
from .texts import word_counts

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json"}

# With buffer_size=1 (the files' order only) the buffer is empty at every sample, so a saved state loses
# nothing, but datasets warns that it might on every resume; and its JSON reader logs a parse error before
# raising it, which `scan` reports itself, with the line.
logging.getLogger("datasets.iterable_dataset").addFilter(
    lambda record: "shuffle buffer" not in record.getMessage()
)
logging.getLogger("datasets.packaged_modules.json.json").addFilter(
    lambda record: "Failed to load JSON" not in record.getMessage()
)


def resolve(spec: str, project: Path) -> tuple[str, list[str]]:
    """(the `datasets` builder, the files) of `data_files`: paths or globs separated by commas, relative to
    the project folder; all of one format."""
    files: list[str] = []
    for part in (part.strip() for part in spec.split(",")):
        path = Path(os.path.expanduser(part))
        pattern = str(path if path.is_absolute() else project / path)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [match for match in matches if Path(match).is_file()]
        if not matches:
            raise ConfigError(f"data_files: {part!r} names no file ({pattern})")
        files += [match for match in matches if match not in files]
    kinds = {Path(file).suffix.lower() for file in files}
    if unknown := kinds - FORMATS.keys():
        raise ConfigError(
            f"data_files: {', '.join(sorted(unknown))} files cannot be read: give .parquet, .csv or .jsonl"
        )
    if len(kinds) > 1:
        raise ConfigError(f"data_files mixes {', '.join(sorted(kinds))} files: stream one format at a time")
    return FORMATS[kinds.pop()], files


def open_stream(builder: str, files: list[str], columns: list[str]) -> datasets.IterableDataset:
    """The files' rows, `columns` only; a ConfigError names a parquet or csv file that lacks one."""
    for file in files:
        if builder == "parquet":
            import pyarrow.parquet

            present = pyarrow.parquet.read_schema(file).names
        elif builder == "csv":
            with open(file, newline="", encoding="utf-8") as handle:
                present = next(csv.reader(handle), [])
        else:
            continue  # a jsonl row may lack a key anywhere: `scan` finds it with its line
        if missing := [column for column in columns if column not in present]:
            raise ConfigError(
                f"{file}: no column {missing[0]!r} (it has {', '.join(present) or 'none'}): rename it, or "
                "set text_column and label_column"
            )
    # Imported here, not with the module: only data_files needs it (the text preset's `data` extra).
    load_dataset = require("datasets", "datasets>=5.1").load_dataset
    stream = load_dataset(builder, data_files=files, split="train", streaming=True)
    return stream.select_columns(columns)


def held_out(text: str, eval_fraction: float) -> bool:
    """Whether `text` belongs to the eval split: a hash of it, not its position, decides."""
    return zlib.crc32(text.encode()) < eval_fraction * 2**32


def scan(
    builder: str, files: list[str], text_column: str, label_column: str, eval_fraction: float
) -> tuple[Counter[str], list[tuple[str, str]], list[str]]:
    """One pass over the files: (the training texts' word counts, the eval examples as (text, label), the
    label names, sorted). A ConfigError names the file (and line) of a row that cannot be read."""
    stream = open_stream(builder, files, [text_column, label_column])
    eval_examples: list[tuple[str, str]] = []
    labels: set[str] = set()

    def train_texts() -> Any:
        for row in stream:
            text = row[text_column]
            label = row[label_column]
            if not isinstance(text, str) or not text.strip() or label is None:
                raise ValueError("a row without text or label")
            labels.add(str(label))
            if held_out(text.strip(), eval_fraction):
                eval_examples.append((text.strip(), str(label)))
            else:
                yield text.strip()

    try:
        counts = word_counts(train_texts())
    except Exception as error:  # pyarrow's and datasets' errors do not say where: find the row
        raise ConfigError(
            bad_row(builder, files, text_column, label_column) or f"data_files: cannot read them: {error}"
        ) from error
    if len(labels) < 2:
        raise ConfigError(f"data_files: {len(labels)} label(s) in the files; need 2 or more")
    if not eval_examples or not counts:
        raise ConfigError(f"eval_fraction={eval_fraction} leaves no train or no eval examples in data_files")
    return counts, eval_examples, sorted(labels)


def bad_row(builder: str, files: list[str], text_column: str, label_column: str) -> str:
    """'file:line: what is wrong' for the first row of jsonl or csv files that is not JSON or lacks the text
    or the label; "" if none is found (a parquet file, or another error)."""
    if builder == "parquet":
        return ""
    for file in files:
        with open(file, newline="", encoding="utf-8") as handle:
            if builder == "csv":
                rows = ((reader.line_num, row) for reader in [csv.DictReader(handle)] for row in reader)
            else:
                rows = enumerate(handle, start=1)
            for number, row in rows:
                if builder == "json":
                    if not row.strip():
                        continue
                    try:
                        row = json.loads(row)
                    except ValueError as error:
                        return f"{file}:{number}: not JSON ({error}): write one JSON object per line"
                    if not isinstance(row, dict):
                        return f"{file}:{number}: not a JSON object: write one object per line"
                for column in (text_column, label_column):
                    if row.get(column) is None or not str(row[column]).strip():
                        return f"{file}:{number}: no {column!r}: every row needs a text and a label"
    return ""


def train_stream(
    builder: str,
    files: list[str],
    columns: tuple[str, str],
    eval_fraction: float,
    seed: int,
    encode: Any,
) -> datasets.IterableDataset:
    """The training rows, encoded by `encode(text, label)` into a sample, in a seeded order of the files that
    changes with `set_epoch`; resumable exactly with its `state_dict`. Its functions are module-level ones
    (with functools.partial), so that it pickles for worker processes started by spawn (macOS, Windows)."""
    stream = open_stream(builder, files, list(columns)).shuffle(seed=seed, buffer_size=1)
    kept = functools.partial(for_training, text_column=columns[0], eval_fraction=eval_fraction)
    encoded = functools.partial(encode_row, columns=columns, encode=encode)
    return stream.filter(kept).map(encoded, remove_columns=list(columns))


def for_training(row: dict[str, Any], text_column: str, eval_fraction: float) -> bool:
    return not held_out(row[text_column].strip(), eval_fraction)


def encode_row(row: dict[str, Any], columns: tuple[str, str], encode: Any) -> dict[str, Any]:
    return encode(row[columns[0]].strip(), str(row[columns[1]]))


def encoder(tokenizer: PreTrainedTokenizerBase, max_length: int, labels: list[str]) -> Any:
    """encode(text, label) -> a training sample: the tokenized text (truncated) and the label's id."""
    ids = {label: index for index, label in enumerate(labels)}
    return functools.partial(encode_text, tokenizer=tokenizer, max_length=max_length, ids=ids)


def encode_text(
    text: str, label: str, tokenizer: PreTrainedTokenizerBase, max_length: int, ids: dict[str, int]
) -> dict[str, Any]:
    return {**tokenizer(text, truncation=True, max_length=max_length), "labels": ids[label]}
