"""Run by 3 processes: load a 2-process FSDP checkpoint (DCP reshards it) and train on.

usage: fsdp_reshard.py CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

checkpoint, out_dir = sys.argv[1], sys.argv[2]
acc = Accelerator(
    fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
    step_scheduler_with_optimizer=False,
)  # one LR step per call, at any number of processes
model = make_model(seed=5)
opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
model, opt, sched = acc.prepare(model, opt, sched)
results: dict = {}
try:
    acc.load_state(checkpoint, strict_world_size=True)
except ValueError as e:
    results["strict_error"] = str(e)
acc.load_state(checkpoint)  # a resize just works (strict_world_size=False is the default)
r, n = acc.process_index, acc.num_processes
results["local_numel"] = {k: p.to_local().numel() for k, p in model.blocks[0].named_parameters()}
loaded = acc.get_state_dict(model)
losses = []
for x, y in batches(8)[3:6]:
    loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    losses.append(acc.reduce(loss.detach(), "mean").item())
results["losses"] = losses
final = acc.get_state_dict(model)
if acc.is_main_process:
    torch.save({"loaded": loaded, "final": final}, os.path.join(out_dir, "reshard_weights.pt"))
with open(os.path.join(out_dir, f"reshard{dist.get_rank()}.json"), "w") as f:
    json.dump(results, f)
