"""The tiny model and data of the N-D parallelism checks (nd_checks.py, test_parallelism.py)."""

from __future__ import annotations

import torch
from torch import nn

N = 96  # samples


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def dataset():
    """(x, y, sample index) rows: the index shows which rank read which sample."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))
