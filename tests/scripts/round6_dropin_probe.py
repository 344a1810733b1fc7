"""Run by `hasten launch` from tests/test_reliability_round6_dropin.py: what a worker got.

usage: round6_dropin_probe.py OUT_DIR (env | fsdp)

env:  builds Accelerator(mixed_precision="bf16") recording its warnings, and writes the thread count
      and world size the launcher gave (OUT_DIR/rank{RANK}.json).
fsdp: builds Accelerator() from the launcher's settings, prepares a model whose `_no_split_modules`
      names its `Block` (and a class it does not contain), trains a step and writes whether each
      block became a unit of its own.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch import nn

from hasten import Accelerator


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class Net(nn.Module):
    _no_split_modules = ["Block", "AudioLayer"]  # as a transformers model: one class it does not build

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


out, mode = sys.argv[1], sys.argv[2]
report: dict = {
    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    "torch_threads": torch.get_num_threads(),
    "world_size": os.environ.get("WORLD_SIZE"),
}
if mode == "env":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(mixed_precision="bf16", cpu=True)
    report["warnings"] = [str(w.message) for w in caught]
    report["mixed_precision"] = acc.mixed_precision
else:
    acc = Accelerator()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    loss = model(torch.randn(8, 16)).square().mean()
    acc.backward(loss)
    opt.step()
    inner = acc.unwrap_model(model)
    report["blocks_are_units"] = [type(b).__name__.startswith("FSDP") for b in inner.blocks]
    report["head_is_unit"] = type(inner.head).__name__.startswith("FSDP")
    report["distributed_type"] = str(acc.distributed_type)
report["processes"] = acc.num_processes
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(report, f)
