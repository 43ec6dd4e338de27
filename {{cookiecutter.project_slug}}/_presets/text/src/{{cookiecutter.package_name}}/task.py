"""The task: all that train.py and predict.py know about the data, the model and the metrics. Text: who
says it? Classify passages of Shakespeare by speaker (the 4 with the most speeches) with a tiny BERT from
Hugging Face transformers, built with random weights and a word-level tokenizer trained on the shipped
texts, so that it all runs offline; `pretrained_model` switches to a hub checkpoint. Your own task:
docs/own-task.md."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .fine_tuning import FineTuningConfig
from .utils.config import Check, ConfigError, setting

# torch, transformers and the data/ and models/ modules are imported inside the functions that use them, so
# that `train.py --help` and config errors answer before torch loads (seconds).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .data.texts import TokenizedTexts

PROJECT_DIR = Path(__file__).resolve().parents[2]  # src/<package>/task.py -> the folder with train.py


@dataclass
class Config(FineTuningConfig):
    # This task's fields (each is a YAML key and a --flag), each with its meaning for --help; those of
    # fine-tuning are FineTuningConfig's. A pretrained_model (e.g. bert-base-uncased) brings its tokenizer and
    # replaces the tiny BERT, whose vocab_size, hidden_size, num_layers and num_heads are then unused.
    # A relative data_file is taken from the project folder (format: data/texts.py).
    data_file: str = setting("data/shakespeare_speakers.txt", "the texts, one label<TAB>text per line")
    # Streamed instead of read into memory (data/text_files.py): train with max_steps; read in num_workers
    # processes, each whole files (utils/training/streams.py).
    data_files: str = setting(
        "", "local parquet, csv or jsonl files to stream instead of data_file: globs, comma-separated"
    )
    shuffle_window: int = setting(
        1024, "data_files: rows are shuffled in windows of this many, a row moving at most window - 1 places"
    )
    text_column: str = setting("text", "data_files: the column of the texts")
    label_column: str = setting("label", "data_files: the column of the labels")
    eval_fraction: float = setting(0.2, "share of the texts held out for evaluation")
    max_length: int = setting(64, "tokens per text, [CLS] and [SEP] included; longer texts are truncated")
    # The shipped training texts give 1,389 (words seen twice + special tokens).
    vocab_size: int = setting(4000, "the word-level tokenizer's vocabulary, at most")
    hidden_size: int = setting(128, "the tiny BERT's hidden size")
    num_layers: int = setting(2, "the tiny BERT's transformer layers")
    num_heads: int = setting(4, "the tiny BERT's attention heads")
    dropout: float = setting(0.1, "the model's hidden and attention dropout")
    # TrainConfig's defaults that this task sets otherwise.
    num_epochs: int = 15
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    best_metric: str = "eval/accuracy"

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/accuracy": "max", "eval/loss": "min"}
    CHECKS: ClassVar[list[Check]] = [
        *FineTuningConfig.CHECKS,
        ("data_file", lambda v: v.strip() != "", "a path"),
        ("text_column", lambda v: v.strip() != "", "a column name"),
        ("label_column", lambda v: v.strip() != "", "a column name"),
        ("eval_fraction", lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"),
        ("max_length", lambda v: v >= 3, ">= 3 ([CLS], a token, [SEP])"),
        ("shuffle_window", lambda v: v >= 0, ">= 0 (0 or 1: the files' order)"),
        # 4: data/texts.py's SPECIAL_TOKENS, the start of every vocabulary
        ("vocab_size", lambda v: v > 4, "> 4 (the special tokens [PAD], [UNK], [CLS] and [SEP])"),
        ("hidden_size", lambda v: v > 0, "> 0"),
        ("num_layers", lambda v: v > 0, "> 0"),
        ("num_heads", lambda v: v > 0, "> 0"),
        ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ]


def read_splits(config: Config) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """(train, eval) lists of (text, label), and the label names, sorted: label id i is labels[i]."""
    from .data.texts import read_labeled_texts, split_examples

    path = Path(os.path.expanduser(config.data_file))
    examples = read_labeled_texts(path if path.is_absolute() else PROJECT_DIR / path)
    train, eval_ = split_examples(examples, config.seed, config.eval_fraction)
    if not train or not eval_:
        raise ConfigError(f"eval_fraction={config.eval_fraction} leaves no train or no eval examples")
    return train, eval_, sorted({label for _, label in examples})


def summary(config: Config) -> tuple[Counter[str], list[tuple[str, str]], list[str]]:
    """(the training texts' word counts, the eval examples, the label names sorted: label id i is labels[i]),
    from data_file, or from one pass over data_files (made once per process)."""
    from .data.texts import word_counts

    if config.data_files:
        from .data.text_files import resolve

        builder, files = resolve(config.data_files, PROJECT_DIR)
        return _scanned(builder, tuple(files), config.text_column, config.label_column, config.eval_fraction)
    train, eval_, labels = read_splits(config)
    return word_counts(text for text, _ in train), eval_, labels


@functools.cache
def _scanned(builder: str, files: tuple[str, ...], text: str, label: str, eval_fraction: float) -> tuple:
    from .data.text_files import scan

    return scan(builder, list(files), text, label, eval_fraction)


def build_tokenizer(config: Config) -> PreTrainedTokenizerBase:
    """The pretrained model's tokenizer, or a word-level one built from the training texts (deterministic:
    train.py and predict.py rebuild the same one from the config and the data)."""
    from .data.texts import build_word_tokenizer
    from .models.transformer import load_pretrained_tokenizer

    if config.pretrained_model:
        return load_pretrained_tokenizer(config.pretrained_model)
    return build_word_tokenizer(summary(config)[0], config.vocab_size, config.max_length)


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    """The train set (a stream with data_files) and the eval set, tokenized."""
    from .data.texts import TokenizedTexts
    from .utils.training.streams import check_stream_settings

    if config.data_files:
        check_stream_settings(config)  # before the scan of the files, which may be long
    _, eval_, labels = summary(config)
    tokenizer = build_tokenizer(config)
    collate.use(tokenizer)

    def tokenized(part: list[tuple[str, str]]) -> TokenizedTexts:
        texts = [text for text, _ in part]
        return TokenizedTexts(texts, tokenizer, config.max_length, [labels.index(label) for _, label in part])

    if config.data_files:
        from .data.text_files import encoder, resolve, train_stream

        builder, files = resolve(config.data_files, PROJECT_DIR)
        columns = (config.text_column, config.label_column)
        encode = encoder(tokenizer, config.max_length, labels)
        train = train_stream(builder, files, columns, config.eval_fraction, config.seed, encode)
        return train, tokenized(eval_)
    return tokenized(read_splits(config)[0]), tokenized(eval_)


class PadCollate:
    """`collate`: pads tokenized texts to the longest one. The tokenizer depends on the config, which collate
    is not given: build_datasets and predict_inputs hand it over here first (workers get a pickled copy)."""

    def __init__(self) -> None:
        self.collator = None

    def use(self, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import DataCollatorWithPadding

        self.collator = DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def __call__(self, samples: list[dict[str, Any]]) -> Mapping[str, Any]:
        if self.collator is None:
            raise RuntimeError("call build_datasets or predict_inputs first: they build the tokenizer")
        # input_ids, attention_mask and labels, one row per text; and the texts, to predict
        batch = self.collator([{k: v for k, v in sample.items() if k != "text"} for sample in samples])
        if "text" in samples[0]:
            batch["text"] = [sample["text"] for sample in samples]
        return batch


collate = PadCollate()


def build_model(config: Config) -> torch.nn.Module:
    """The network as it trains: the base model, with LoRA and gradient checkpointing if asked for."""
    from .models.pretrained import for_training

    return for_training(build_base(config), config)


def build_base(config: Config) -> PreTrainedModel:
    """The pretrained model with a new head over the labels, or the tiny BERT with random weights."""
    from .models.transformer import build_pretrained, build_tiny_bert

    labels = summary(config)[2]
    if config.pretrained_model:
        return build_pretrained(config.pretrained_model, labels, config.dropout)
    vocab_size = len(build_tokenizer(config))
    return build_tiny_bert(
        vocab_size,
        labels,
        config.max_length,
        config.hidden_size,
        config.num_layers,
        config.num_heads,
        config.dropout,
    )


def export(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], folder: Path, config: Config) -> None:
    """model/ and best_model/ as Hugging Face folders with the tokenizer: from_pretrained(folder) and
    pipeline("text-classification", model=folder) read them (under LoRA: the adapter, and with merge_lora
    the merged model in folder/merged)."""
    from .models.pretrained import save_folder

    save_folder(model, state_dict, folder, build_tokenizer(config), config)


def load_export(folder: Path, config: Config) -> torch.nn.Module:
    """What `export` wrote: an adapter on this machine's pretrained_model, or a whole model."""
    from .models.pretrained import load_folder, transformers

    return load_folder(transformers.AutoModelForSequenceClassification, folder, lambda: build_base(config))


def without_padding_columns(batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The batch without the token columns that are padding in every row: a micro-batch cut from a longer
    batch then has the shape it would have had if collated alone, as in 2 processes, so 1 and 2 processes
    compute exactly the same numbers. It costs one host-device sync per micro-batch."""
    mask = batch["attention_mask"]
    keep = mask.bool().any(dim=0)
    if keep.all():
        return batch
    width = mask.shape[1]
    return {name: (v[:, keep] if v.dim() == 2 and v.shape[1] == width else v) for name, v in batch.items()}


def loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # Hugging Face models compute their own loss when the batch has labels (cross-entropy here).
    return model(**without_padding_columns(batch)).loss


def eval_step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    batch = without_padding_columns(batch)
    labels = batch["labels"]
    logits = model(**batch).logits.float()
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),
        "hit": (logits.argmax(dim=-1) == labels).float(),
    }


def metrics(values: dict[str, torch.Tensor], config: Config) -> dict[str, float]:
    return {
        "eval/loss": values["loss"].double().mean().item(),
        "eval/accuracy": values["hit"].sum().item() / values["hit"].numel(),
    }


def predict_inputs(config: Config, path: Path | None) -> Dataset:
    """The eval split with labels, or the texts of a UTF-8 text file, one text per line; each item with
    its text, which the predictions show."""
    from .data.texts import TokenizedTexts

    if path is None:
        _, eval_, labels = summary(config)  # data_file's eval split, or data_files' held-out texts
        texts = [text for text, _ in eval_]
        ids = [labels.index(label) for _, label in eval_]
    else:
        texts = read_texts(path)
        ids = None
    tokenizer = build_tokenizer(config)
    collate.use(tokenizer)
    return TokenizedTexts(texts, tokenizer, config.max_length, labels=ids, with_text=True)


def predict(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], config: Config
) -> list[dict[str, Any]]:
    """The text, the predicted label, the true one when known, and the probability of each label."""
    inputs = {name: values for name, values in batch.items() if name not in ("labels", "text")}
    probs = model(**inputs).logits.float().softmax(dim=-1).cpu()
    names = model.config.id2label  # label id -> name, set by build_model
    rows = []
    for index, row in enumerate(probs.tolist()):
        out: dict[str, Any] = {"text": batch["text"][index], "prediction": names[int(probs[index].argmax())]}
        if "labels" in batch:
            out["label"] = names[int(batch["labels"][index])]
        out.update({f"prob_{names[k]}": p for k, p in enumerate(row)})
        rows.append(out)
    return rows


def read_texts(path: Path) -> list[str]:
    """The lines of a text file; a ConfigError names the file (and line) when it is missing, a folder,
    unreadable or not text (a binary file), or when there is nothing to predict."""
    expected = "a UTF-8 text file with one text per line"
    if path.is_dir():
        raise ConfigError(f"input {path} is a folder; expected {expected}")
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); expected {expected}"
        ) from None
    except OSError as error:
        raise ConfigError(f"cannot read input file {path}: {error.strerror or error}") from None
    if not lines:
        raise ConfigError(f"{path}: the file is empty; expected one text per line")
    for number, line in enumerate(lines, start=1):
        if "\0" in line:
            raise ConfigError(f"{path}:{number}: a NUL byte, so a binary file; expected {expected}")
        if not line.strip():
            # An empty line would shift every following row's index away from its line number.
            raise ConfigError(f"{path}:{number}: empty line; expected one text per line")
    return lines
