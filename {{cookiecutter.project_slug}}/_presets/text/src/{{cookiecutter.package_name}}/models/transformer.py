"""A Hugging Face sequence classifier: a tiny BERT with random weights (offline), or a pretrained checkpoint.

Replace it with your own network; task.py builds it. Any `AutoModelForSequenceClassification` fits the task
as it is: it takes the tokenizer's batch and returns `.loss` (with labels) and `.logits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..utils.config import ConfigError
from ..utils.packages import require

transformers = require("transformers", "transformers>=4.46")

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The dropout settings of the common encoder families (BERT/RoBERTa/ELECTRA, DistilBERT): `dropout` sets
# those the checkpoint's config has.
DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout")


def build_tiny_bert(
    vocab_size: int,
    labels: list[str],
    max_length: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    dropout: float,
) -> PreTrainedModel:
    """A BERT encoder of the given size with random weights and a classification head over `labels`."""
    if hidden_size % num_heads:
        raise ConfigError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}")
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=4 * hidden_size,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        max_position_embeddings=max_length,
        type_vocab_size=1,  # one text per example: no sentence pairs
        pad_token_id=0,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    return transformers.AutoModelForSequenceClassification.from_config(config)


def build_pretrained(name: str, labels: list[str], dropout: float) -> PreTrainedModel:
    """The checkpoint `name` (hub name or local folder) with a new classification head over `labels`."""
    try:
        config = transformers.AutoConfig.from_pretrained(
            name, id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
        )
        for field in DROPOUT_FIELDS:
            if hasattr(config, field):
                setattr(config, field, dropout)
        return transformers.AutoModelForSequenceClassification.from_pretrained(name, config=config)
    except OSError as error:
        raise ConfigError(cannot_load(name, error)) from error


def load_pretrained_tokenizer(name: str) -> PreTrainedTokenizerBase:
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except OSError as error:
        raise ConfigError(cannot_load(name, error)) from error


def cannot_load(name: str, error: OSError) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"pretrained_model={name!r} could not be loaded ({reason}). A hub checkpoint is downloaded on first "
        "use, which needs the network (then it is cached under ~/.cache/huggingface); offline, pass a local "
        "folder saved with save_pretrained, or leave pretrained_model empty for the tiny model built here"
    )
