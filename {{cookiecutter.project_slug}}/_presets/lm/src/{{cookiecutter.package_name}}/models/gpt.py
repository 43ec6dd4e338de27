"""A small GPT (decoder-only transformer) in plain PyTorch, after nanoGPT (docs/task.md, "Model"): replace it
with your own network; task.py builds it. With `tie_embeddings` the head's weight is the token embedding's:
safetensors files hold it under one name, and checkpoints and predict.py load it back under both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # [batch, length, 3 * width] -> three [batch, heads, length, head width]
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        # is_causal: position t attends to positions <= t only, so a prediction never sees its target.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


class Block(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim),
            nn.GELU(),
            nn.Linear(4 * embed_dim, embed_dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        num_layers: int,
        num_heads: int,
        embed_dim: int,
        dropout: float,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(block_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, dropout) for _ in range(num_layers)])
        self.ln_final = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab_size)
        # GPT-2's initialization: small normal weights, and the layers that add to the residual stream
        # scaled down by the depth, so that the stream's variance does not grow with the number of layers.
        residual = ("attn.proj.weight", "mlp.2.weight")
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.dim() > 1:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(residual) else 0.02
                nn.init.normal_(parameter, mean=0.0, std=std)
        if tie_embeddings:  # after the initialization: untied models draw the same weights as before
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, length, vocab] for token ids [batch, length], length <= block_size."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        return self.head(self.ln_final(self.blocks(x)))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    num_new: int,
    block_size: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """`num_new` ids that follow the ids `prompt` (1-D, at least one), drawn one at a time.

    Each draw conditions on the last `block_size` ids, divides the logits by `temperature` (below 1:
    more likely characters, more often; 0: always the most likely) and keeps the `top_k` most likely
    (0: all). Only `generator`, a CPU generator, is drawn from: the text depends on it and the model alone.
    """
    tokens = prompt
    for _ in range(num_new):
        logits = model(tokens[-block_size:][None])[0, -1].float().cpu()
        if temperature == 0:
            next_id = logits.argmax().reshape(1)
        else:
            logits = logits / temperature
            if top_k:
                cutoff = logits.topk(min(top_k, len(logits))).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_id = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_id.to(tokens.device)])
    return tokens[len(prompt) :]
