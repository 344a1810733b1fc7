"""Run by 2 processes on 2 CUDA GPUs: context parallelism (cp_size=2) trains like one process.

usage: nd_cp.py OUT_DIR. Each rank holds half of every sequence inside maybe_context_parallel;
the reference is the same model on the whole sequences, on each rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from hasten import Accelerator, ParallelismConfig


class Attn(nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


acc = Accelerator(mixed_precision="bf16", parallelism_config=ParallelismConfig(cp_size=2))
torch.manual_seed(0)
model, ref = Attn(), Attn()
ref.load_state_dict(model.state_dict())
ref = ref.to(acc.device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
g = torch.Generator().manual_seed(1)
losses, ref_losses = [], []
for _ in range(3):
    x = torch.randn(2, 256, 64, generator=g).to(acc.device)
    y = torch.randn(2, 256, 64, generator=g).to(acc.device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        rloss = nn.functional.mse_loss(ref(x).float(), y)
    rloss.backward()
    ropt.step()
    ropt.zero_grad()
    ref_losses.append(rloss.item())
    xs, ys = x.clone(), y.clone()
    with acc.maybe_context_parallel(buffers=[xs, ys], buffer_seq_dims=[1, 1], no_restore_buffers={xs, ys}):
        loss = nn.functional.mse_loss(model(xs).float(), ys)  # this rank's half of the sequence
        acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(acc.reduce(loss.detach(), "mean").item())
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"losses": losses, "ref_losses": ref_losses}, f)
