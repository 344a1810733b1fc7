"""Run by `hasten launch --config_file <a file in Accelerate's format>`: what `Accelerator()` got from it.

usage: accelerate_config_report.py OUT_DIR

Builds `Accelerator()` with no arguments (everything from the launcher), prepares a small model with
a repeated `Block` (so `fsdp_transformer_layer_cls_to_wrap: Block` shards it), trains two steps and
writes OUT_DIR/rank{RANK}.json (read by tests/test_accelerate_config.py).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch import nn

from hasten import Accelerator

warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


acc = Accelerator()
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for _ in range(2):
    loss = model(torch.randn(16, 32)).square().mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
plugin = acc.fsdp_plugin
config = acc.parallelism_config
inner = acc.unwrap_model(model)
report = {
    "processes": acc.num_processes,
    "distributed_type": str(acc.distributed_type),
    "mixed_precision": acc.mixed_precision,
    "backend": acc.state.backend,
    "fsdp_version": plugin.fsdp_version if plugin else None,
    "state_dict_type": plugin.state_dict_type if plugin else None,
    "reshard_after_forward": plugin.reshard_after_forward if plugin else None,
    "wrap": plugin.auto_wrap_policy if plugin else None,
    "mesh": config.sizes() if config is not None else None,
    "mesh_shape": list(acc.torch_device_mesh.shape) if acc.torch_device_mesh is not None else None,
    "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in inner.modules()),
    "fp8_backend": str(acc.fp8_backend),
    "dynamo_backend": str(acc.dynamo_plugin.backend) if acc.dynamo_plugin else None,
    "block_sharded": type(inner.blocks[0].up.weight).__name__,
    "debug_mode": os.environ.get("HASTEN_DEBUG_MODE"),
    "loss_finite": bool(torch.isfinite(loss).item()),
}
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as f:
    json.dump(report, f)
