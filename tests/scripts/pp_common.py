"""The tiny Llama-style model and data of the pipeline-parallel checks (pp_checks.py, test_pipeline.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, SEQ = 16, 16, 4, 3  # DIM 16: fp8 converts Linear layers whose dims are multiples of 16
N = 64  # samples
#: tensor parallelism of each block's MLP (ParallelismConfig.tp_plan)
TP_PLAN = {"layers.*.w1": "colwise", "layers.*.w2": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.silu(self.w1(self.ffn_norm(h))))


class Llama(nn.Module):
    """torchtitan's contract: the forward skips the parts a pipeline stage lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (N, SEQ), generator=g)
    return torch.utils.data.TensorDataset(tokens, torch.roll(tokens, -1, dims=1))
