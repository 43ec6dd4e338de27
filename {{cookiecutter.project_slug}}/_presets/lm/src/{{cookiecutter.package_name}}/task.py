"""The task: all that train.py and predict.py know about the data, the model and the metrics. lm: a small
GPT that predicts the next character of a text (Shakespeare's plays by default), and writes text from
prompts. Your own task: docs/own-task.md."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .utils.config import Check, ConfigError, TrainConfig, session, setting

# torch and the data/ and models/ modules load inside the functions: --help answers at once (own-task.md).
if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from .data.chars import Corpus

PROJECT_DIR = Path(__file__).resolve().parents[2]  # src/<package>/task.py -> the folder with train.py
NUM_EVAL_PROMPTS = 8  # predict.py without --input: prompts cut from the eval text


@dataclass
class Config(TrainConfig):
    # A relative data_file is taken from the project folder.
    data_file: str = setting(
        "data/tinyshakespeare.txt",
        "the training text, UTF-8, or a folder of token shards made by prepare.py (a corpus of any size, "
        "read through np.memmap)",
    )
    eval_fraction: float = setting(0.1, "share of the text, at its end, held out for evaluation")
    eval_windows: int = setting(500, "evaluate on this many windows spread over the held-out text")
    block_size: int = setting(64, "characters of context")
    num_layers: int = setting(4, "the GPT's transformer layers")
    num_heads: int = setting(4, "the GPT's attention heads (they divide embed_dim)")
    embed_dim: int = setting(128, "the GPT's embedding width")
    dropout: float = setting(0.0, "the GPT's dropout")
    tie_embeddings: bool = setting(False, "the output head shares the token embedding's weights (as GPT-2)")
    # Sampling (predict.py): they may change after training, e.g. --sample_chars 500.
    sample_chars: int = session(200, "predict.py: characters written after each prompt")
    temperature: float = session(0.8, "predict.py: sampling temperature; below 1, safer text")
    top_k: int = session(0, "predict.py: draw from the k most likely characters only")
    # TrainConfig's defaults that this task sets otherwise (an epoch: 15,684 windows, 245 steps of 64).
    num_epochs: int = 2
    eval_every: int = 100

    METRIC_GOALS: ClassVar[dict[str, str]] = {"eval/loss": "min", "eval/perplexity": "min"}
    CHECKS: ClassVar[list[Check]] = [
        *TrainConfig.CHECKS,
        ("data_file", lambda v: v.strip() != "", "a path to a text file or a folder of token shards"),
        ("eval_fraction", lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"),
        ("eval_windows", lambda v: v >= 0, ">= 0 (0 means all)"),
        ("block_size", lambda v: v > 0, "> 0"),
        ("num_layers", lambda v: v > 0, "> 0"),
        ("num_heads", lambda v: v > 0, "> 0"),
        ("embed_dim", lambda v: v > 0, "> 0"),
        ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("sample_chars", lambda v: v >= 0, ">= 0"),
        ("temperature", lambda v: v >= 0, ">= 0 (0 means the most likely character)"),
        ("top_k", lambda v: v >= 0, ">= 0 (0 means all characters)"),
    ]


def data_path(config: Config) -> Path:
    path = Path(os.path.expanduser(config.data_file))
    return path if path.is_absolute() else PROJECT_DIR / path


def corpus(config: Config) -> Corpus:
    """The text of data_file as ids, and its tokenizer: a text file's sorted characters, or what a folder
    of token shards was prepared with (its tokens then stay on disk)."""
    from .data.chars import load_corpus

    path = data_path(config)
    if path.is_dir():
        return shard_corpus(path)
    if not path.is_file():
        raise ConfigError(f"data_file {path} does not exist")
    try:
        return load_corpus(path)
    except UnicodeDecodeError as error:
        raise ConfigError(f"data_file {path} is not UTF-8 text: {error}") from None


@functools.lru_cache(maxsize=4)
def shard_corpus(folder: Path) -> Corpus:
    """The shards' checksums are read once per process: train.py and predict.py ask for the corpus often."""
    from .data.chars import Corpus
    from .data.shards import DataError, open_shards

    try:
        return Corpus(*open_shards(folder))
    except DataError as error:
        raise ConfigError(f"data_file: {error}") from None


def build_datasets(config: Config) -> tuple[Dataset, Dataset]:
    from .data.chars import EvalWindows, TrainWindows, split_ids

    train_ids, eval_ids = split_ids(corpus(config).ids, config.eval_fraction)
    train_set = TrainWindows(train_ids, config.block_size, config.seed)
    eval_set = EvalWindows(eval_ids, config.block_size, config.eval_windows)
    if not len(eval_set):
        raise ConfigError(
            f"data_file {data_path(config)}: its held-out end ({len(eval_ids)} tokens) is shorter "
            f"than one window of block_size + 1 = {config.block_size + 1} tokens"
        )
    return train_set, eval_set


def collate(samples: list[Any]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Windows stack into [batch, block_size + 1] ids; prompts (predict_inputs) into a dict of padded ids
    with their lengths and their input index, which seeds the sampling."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    if not isinstance(samples[0], dict):
        return torch.stack(samples)
    batch = {"index": torch.tensor([sample["index"] for sample in samples])}
    for key in ("prompt", "continuation"):
        if key in samples[0]:
            batch[key] = pad_sequence([sample[key] for sample in samples], batch_first=True)
            batch[f"{key}_length"] = torch.tensor([len(sample[key]) for sample in samples])
    return batch


def build_model(config: Config) -> torch.nn.Module:
    if config.embed_dim % config.num_heads:
        raise ConfigError(
            f"embed_dim={config.embed_dim} must be divisible by num_heads={config.num_heads}: each head "
            "gets an equal share of the embedding"
        )
    from .models.gpt import GPT

    tokenizer = corpus(config).tokenizer
    sizes = config.block_size, config.num_layers, config.num_heads, config.embed_dim, config.dropout
    model = GPT(tokenizer.size, *sizes, config.tie_embeddings)
    keep_vocabulary(model, tokenizer.digest, config.data_file)
    return model


def keep_vocabulary(model: torch.nn.Module, digest: str, source: str) -> None:
    """Save the vocabulary's SHA-256 with the weights (a buffer), and refuse weights saved with another one:
    the same number of ids would load without a word and read every id as the wrong character."""
    import torch

    model.register_buffer("vocabulary_sha256", torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8))

    def check(module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        saved = state_dict.get(f"{prefix}vocabulary_sha256")
        if saved is not None and not torch.equal(saved.cpu(), module.vocabulary_sha256.cpu()):
            raise ConfigError(
                f"these weights were trained on another vocabulary than data_file {source}'s: give the "
                "data_file they were trained on, or prepare the new data with the same tokenizer"
            )

    if hasattr(model, "register_load_state_dict_pre_hook"):
        model.register_load_state_dict_pre_hook(check)
    else:  # torch before 2.5: the same hook under its earlier, private name (.ci/lowest found it)
        model._register_load_state_dict_pre_hook(check, with_module=True)


def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each character of a window from the ones before it."""
    import torch.nn.functional as F

    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def eval_step(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per window: the sum of its token losses and its token count, so that the mean over all tokens is
    exact however the windows were split between processes."""
    import torch.nn.functional as F

    inputs = batch[:, :-1]
    targets = batch[:, 1:]  # each position's next token
    logits = model(inputs).float()
    token_losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [batch, length]
    tokens = targets.new_full((len(targets),), targets.shape[1])
    return {"loss_sum": token_losses.sum(dim=1), "tokens": tokens}


def metrics(values: dict[str, torch.Tensor], config: Config) -> dict[str, float]:
    """Mean loss per character (nats) and its perplexity, exp(loss) (docs/task.md, "Quality")."""
    mean = (values["loss_sum"].double().sum() / values["tokens"].sum()).item()
    return {"eval/loss": mean, "eval/perplexity": math.exp(mean)}


def predict_inputs(config: Config, path: Path | None) -> list[dict[str, Any]]:
    """Prompts: one per line of the text file `path`, or, with `path` None, NUM_EVAL_PROMPTS cut from the
    eval text at line starts, each with the `sample_chars` characters that truly follow it."""
    from .data.chars import split_ids

    text = corpus(config)
    if path is not None:
        return read_prompts(path, text, config.data_file)
    _, ids = split_ids(text.ids, config.eval_fraction)
    length = config.block_size
    follow = config.sample_chars
    room = max(0, len(ids) - length - follow)
    newline = text.tokenizer.line_break
    items = []
    for index in range(NUM_EVAL_PROMPTS):
        start = index * room // NUM_EVAL_PROMPTS
        breaks = (ids[start : start + length] == newline).nonzero()
        if len(breaks) and start + int(breaks[0]) + 1 <= room:
            start += int(breaks[0]) + 1  # begin at the start of a line, as a reader would
        prompt = ids[start : start + length]
        continuation = ids[start + length : start + length + follow]
        items.append({"index": index, "prompt": prompt, "continuation": continuation})
    return items


def read_prompts(path: Path, text: Corpus, source: str) -> list[dict[str, Any]]:
    """The prompts of a file; a ConfigError names the file, and the line and character the model cannot
    read, or says why it is no text file of prompts."""
    expected = "a UTF-8 text file with one prompt per line"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); expected {expected}"
        ) from None
    except OSError as error:  # a missing file, a folder
        raise ConfigError(f"cannot read input file {path}: {error.strerror or error}") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            items.append({"index": len(items), "prompt": text.tokenizer.encode(line)})
        except ValueError as error:
            raise ConfigError(f"{path}:{number}: {error} (the characters of {source})") from None
    if not items:
        raise ConfigError(f"{path}: no prompts; expected {expected}")
    return items


def predict(model: torch.nn.Module, batch: dict[str, torch.Tensor], config: Config) -> list[dict[str, Any]]:
    """The prompt, the text the model writes after it and, for prompts from the eval text, the text that
    truly follows. One prompt at a time: its text then depends on neither the batch nor the process."""
    from .models.gpt import generate

    tokenizer = corpus(config).tokenizer
    rows = []
    for row, index in enumerate(batch["index"].tolist()):
        prompt = batch["prompt"][row, : batch["prompt_length"][row]]
        written = generate(
            model,
            prompt,
            config.sample_chars,
            config.block_size,
            config.temperature,
            config.top_k,
            sampling_generator(config.seed, index),
        )
        out = {"prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(written)}
        if "continuation" in batch:
            out["true_continuation"] = tokenizer.decode(
                batch["continuation"][row, : batch["continuation_length"][row]]
            )
        rows.append(out)
    return rows


def sampling_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of prompt `index`, a function of (seed, index) only (docs/task.md)."""
    import numpy as np
    import torch

    return torch.Generator().manual_seed(int(np.random.default_rng([seed, index]).integers(2**63)))
