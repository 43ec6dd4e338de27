"""Labeled texts from a tab-separated file, their split, and a word-level tokenizer built from them offline.

Replace this module with your own data; task.py is the only caller."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset

from ..utils.config import ConfigError
from ..utils.machine.packages import require

# At import, so that a missing package stops train.py and predict.py before they write anything.
transformers = require("transformers", "transformers>=4.46")
tokenizers = require("tokenizers", "tokenizers>=0.20")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Texts are tokenized once, before any DataLoader worker is forked; without this, tokenizers warns at
# every fork and turns its thread pool off anyway (a forked thread pool can deadlock).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# [PAD] first: its id is 0, the BertConfig default. The order of this list is the start of every vocabulary.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
MIN_COUNT = 2  # a word seen once in training teaches the model no more than [UNK] does


def read_labeled_texts(path: Path) -> list[tuple[str, str]]:
    """(text, label) pairs of a file with one example per line, `label<TAB>text`; lines starting with # are
    comments. A ConfigError names the file and line of a bad one."""
    if not path.is_file():
        raise ConfigError(f"data_file {path} does not exist")
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        label, tab, text = line.partition("\t")
        if not tab or not label.strip() or not text.strip():
            raise ConfigError(f"{path}:{number}: expected label<TAB>text, got {line[:80]!r}")
        examples.append((text.strip(), label.strip()))
    labels = {label for _, label in examples}
    if len(labels) < 2:
        raise ConfigError(f"{path}: {len(labels)} label(s) in {len(examples)} examples; need 2 or more")
    return examples


def split_examples(
    examples: list[tuple[str, str]], seed: int, eval_fraction: float
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, eval): a random split that depends only on `seed`, the same in every process and platform."""
    order = np.random.default_rng(seed).permutation(len(examples))
    num_eval = round(len(examples) * eval_fraction)
    return [examples[i] for i in order[num_eval:]], [examples[i] for i in order[:num_eval]]


# Words are lowercased words and punctuation: "thou'rt" -> thou ' rt
normalizer = tokenizers.normalizers.Lowercase()
pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()


def word_counts(texts: Iterable[str]) -> Counter[str]:
    """How often each word occurs in `texts`, read once (a stream of any length: memory grows with the
    vocabulary, not with the texts)."""
    return Counter(
        word for text in texts for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
    )


def build_word_tokenizer(counts: Counter[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerBase:
    """A word-level tokenizer: the special tokens, then the training texts' words seen at least MIN_COUNT
    times, most frequent first (ties alphabetical), `vocab_size` in all. A pure function of its arguments:
    every process and predict.py build the same one, with nothing cached or downloaded."""
    frequent = sorted((w for w, count in counts.items() if count >= MIN_COUNT), key=lambda w: (-counts[w], w))
    tokens = SPECIAL_TOKENS + frequent[: vocab_size - len(SPECIAL_TOKENS)]
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="[UNK]")
    )
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(name, tokens.index(name)) for name in ("[CLS]", "[SEP]")]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=max_length,
        model_input_names=["input_ids", "attention_mask"],
    )


class TokenizedTexts(Dataset):
    """Texts tokenized once, up front (truncated to `max_length` tokens), unpadded, with their label ids if
    known, and with the text itself if `with_text` (predictions show it)."""

    def __init__(
        self,
        texts: list[str],
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        labels: list[int] | None,
        with_text: bool = False,
    ) -> None:
        self.encodings = tokenizer(texts, truncation=True, max_length=max_length)
        self.labels = labels
        self.texts = texts if with_text else None

    def __len__(self) -> int:
        return len(self.encodings["input_ids"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = {name: values[index] for name, values in self.encodings.items()}
        if self.labels is not None:
            item["labels"] = self.labels[index]
        if self.texts is not None:
            item["text"] = self.texts[index]
        return item
