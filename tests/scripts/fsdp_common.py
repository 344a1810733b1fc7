"""A small transformer-like model and a training loop shared by the FSDP scripts and tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm MLP block with a residual connection (what a transformer layer looks like to FSDP)."""

    def __init__(self, dim: int = 12, hidden: int = 36) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, dim: int = 12, blocks: int = 2, classes: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(blocks)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def counting_forwards(model: nn.Module) -> nn.Module:
    """``model`` with a buffer ``forwards`` that every forward adds 1 to (in place, as batch-norm
    statistics change)."""
    model.register_buffer("forwards", torch.zeros(1))
    model.register_forward_pre_hook(lambda m, args: m.forwards.add_(1) and None)
    return model


def batches(n: int, size: int = 24, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 6, (size,), generator=g)) for _ in range(n)]


def reference_train(data, *, accum: int = 1, clip: float | None = None, lr: float = 0.05):
    """Plain PyTorch on one process with the full batches: losses per optimizer step and final weights."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses, norms = [], []
    for i in range(0, len(data), accum):
        step_loss = 0.0
        for x, y in data[i : i + accum]:
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / accum).backward()
            step_loss += loss.item() / accum
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
