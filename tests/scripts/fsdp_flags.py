"""Run by `hasten launch --use_fsdp --fsdp_* ... --dynamo_backend aot_eager`: what the Accelerator built.

usage: fsdp_flags.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model  # noqa: E402

from hasten import Accelerator  # noqa: E402

acc = Accelerator()  # everything from the launcher
plugin = acc.fsdp_plugin
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
losses = []
for x, y in batches(3):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
block = acc.unwrap_model(model).blocks[0]
block = getattr(block, "_checkpoint_wrapped_module", block)  # inside activation checkpointing's wrapper
# the same training without compiling (code wins over the launcher's --dynamo_backend)
eager_acc = Accelerator(dynamo_backend="no", fsdp_plugin=plugin)
eager_model = make_model()
eager_model, eager_opt = eager_acc.prepare(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1))
eager_losses = []
for x, y in batches(3):
    loss = torch.nn.functional.cross_entropy(eager_model(x), y)
    eager_acc.backward(loss)
    eager_opt.step()
    eager_opt.zero_grad()
    eager_losses.append(loss.item())
result = {
    "eager_losses": eager_losses,
    "distributed_type": str(acc.distributed_type),
    "strategy": type(acc.strategy).__name__,
    "wrap": plugin.auto_wrap_policy,
    "classes": plugin.transformer_cls_names_to_wrap,
    "state_dict_type": plugin.state_dict_type,
    "reshard": plugin.reshard_after_forward,
    "activation_checkpointing": plugin.activation_checkpointing,
    "activation_checkpointing_offload": plugin.activation_checkpointing_offload,
    "block_compiled": getattr(block, "_compiled_call_impl", None) is not None,
    "block_sharded": type(block.up.weight).__name__,
    "losses": losses,
}
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as f:
    json.dump(result, f)
