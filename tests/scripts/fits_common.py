"""Models for the "sharding that fits" checks (tests/test_fsdp_fits.py): a small language model
with a tied embedding/head and a non-persistent buffer, and one whose tensors nothing initialises."""

from __future__ import annotations

import torch
from fsdp_common import Block
from torch import nn


class Rope(nn.Module):
    """A rotary-embedding-like scale: a non-persistent buffer, computed (never saved)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._freqs(), persistent=False)

    def _freqs(self) -> torch.Tensor:
        return 1.0 / (100.0 ** (torch.arange(0, self.dim, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:  # what a meta-built model needs to compute it again
        self.inv_freq.copy_(self._freqs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + self.inv_freq)


class LM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rope = Rope(dim)
        self.blocks = nn.Sequential(*[Block(dim, 3 * dim) for _ in range(blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.rope(self.embed(tokens)))))


class Raw(nn.Module):
    """A bare parameter and a non-persistent buffer: no reset_parameters covers them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.register_buffer("shift", torch.full((8,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain + self.shift


def lm_batches(n: int, size: int = 12, seq: int = 6, vocab: int = 64, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (size, seq + 1), generator=g) for _ in range(n)]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
