"""A GPT-style model of identical blocks, shared by the compile and language-model benchmarks.

Pre-norm blocks (causal self-attention, then a 4x MLP), learned token and position embeddings, a final
LayerNorm and an untied head: ``(batch, seq)`` int64 token ids to ``(batch, seq, vocab)`` logits. No dropout,
so train and eval modes compute the same function and every loop of a race draws no random numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; ``x`` is
    ``(batch, seq, width)``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a final norm and a head: ``(batch, seq)`` token ids
    to ``(batch, seq, vocab)`` logits."""

    def __init__(self, depth: int, width: int = 128, heads: int = 4, vocab: int = 256, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)
        self.depth, self.width, self.seq = depth, width, seq

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def flops_per_token(self, seq: int | None = None) -> float:
        """Model FLOPs of one token's forward and backward at sequence length ``seq`` (default: the model's).

        ``6 N`` for the weight matmuls (N: the parameters of every Linear, head included; embeddings are
        lookups) plus ``12 L T d`` for attention's two matmuls, the count of PaLM's appendix B (Chowdhery et
        al., 2022) and nanoGPT's ``estimate_mfu``. Recompute, norms and element-wise work are not counted.
        """
        n = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6.0 * n + 12.0 * self.depth * (seq or self.seq) * self.width
