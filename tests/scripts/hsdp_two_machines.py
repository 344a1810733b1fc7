"""HYBRID_SHARD given in code (Accelerate's FSDP1 name), started as 2 machines x 2 processes by two
launchers on this host: the mesh must be built from the launcher's world (replicate across machines,
shard within one), and training must keep the replicas equal (tests/test_reliability_round6_dropin.py)."""

import json
import os
import sys

import torch
from torch import nn

from hasten import Accelerator, FullyShardedDataParallelPlugin

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD"))
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
mesh = accelerator.torch_device_mesh
groups = {dim: torch.distributed.get_process_group_ranks(mesh[dim].get_group()) for dim in ("dp_replicate", "dp_shard")}
g = torch.Generator().manual_seed(accelerator.process_index)
for _ in range(3):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
local = torch.cat([p.to_local().detach().flatten() for p in model.parameters()])
report = {
    "rank": accelerator.process_index,
    "machine": int(os.environ["GROUP_RANK"]),
    "sizes": [mesh["dp_replicate"].size(), mesh["dp_shard"].size()],
    "groups": groups,
    "local": local.tolist(),
}
with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump(report, f)
