"""A Hugging Face sequence classifier: a tiny BERT with random weights (offline), or a pretrained checkpoint.

Replace it with your own network; task.py builds it (and, for fine-tuning, models/pretrained.py wraps it).
Any `AutoModelForSequenceClassification` fits the task as it is: it takes the tokenizer's batch and returns
`.loss` (with labels) and `.logits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..utils.config import ConfigError
from .pretrained import load_pretrained, load_processor, transformers

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
    settings = dict.fromkeys(DROPOUT_FIELDS, dropout)
    return load_pretrained(transformers.AutoModelForSequenceClassification, name, labels, **settings)


def load_pretrained_tokenizer(name: str) -> PreTrainedTokenizerBase:
    return load_processor(transformers.AutoTokenizer, name)
