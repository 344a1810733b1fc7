"""Run by 2 processes: Accelerate's FSDP2 helpers and distributed utilities of the fifth round.

usage: utils5_fsdp.py OUT_DIR

fsdp2_prepare_model shards a model (then its forward is the unsharded model's);
fsdp2_load_full_state_dict loads a full state dict held by the main process only, into a
prepared model and into one built and sharded on the meta device; load_checkpoint_in_model
loads a safetensors file into the sharded model (every process reading, then the main process
only with broadcast_from_rank0); copy_tensor_to_devices and avg_losses_across_data_parallel_group.
Each rank writes OUT_DIR/rank{RANK}.json (read by tests/test_utils_round5.py).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import TinyNet, batches, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.utils import (  # noqa: E402
    avg_losses_across_data_parallel_group,
    copy_tensor_to_devices,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_model,
    load_checkpoint_in_model,
    model_has_dtensor,
)

out_dir = sys.argv[1]
results: dict = {}
acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
x = batches(1)[0][0]


def same_forward(model: torch.nn.Module, seed: int) -> bool:
    with torch.no_grad():
        return bool(torch.allclose(model(x), make_model(seed)(x), atol=1e-5))


# fsdp2_prepare_model: sharded in place, blocks first, the forward unchanged
model = fsdp2_prepare_model(acc, make_model(0))
results["prepare"] = {
    "root_fsdp": isinstance(model, FSDPModule),
    "blocks_fsdp": [isinstance(b, FSDPModule) for b in model.blocks],
    "dtensor": model_has_dtensor(model),
    "forward": same_forward(model, 0),
    "again_is_same": fsdp2_prepare_model(acc, model) is model,
}

# fsdp2_load_full_state_dict: the main process's full state dict, into the prepared model
fsdp2_load_full_state_dict(acc, model, make_model(3).state_dict() if acc.is_main_process else {})
results["load_full"] = same_forward(model, 3)
try:  # a name missing on the main process: an error on every process, nothing hangs
    partial = {k: t for k, t in make_model(4).state_dict().items() if k != "head.bias"}
    fsdp2_load_full_state_dict(acc, model, partial if acc.is_main_process else {})
    results["missing"] = "no error"
except (KeyError, RuntimeError) as e:
    results["missing"] = type(e).__name__
results["unchanged_after_missing"] = same_forward(model, 3)

# ... into a model built and sharded on the meta device (Accelerate's cpu_ram_efficient_loading way)
with torch.device("meta"):
    meta = TinyNet()
for block in meta.blocks:
    fully_shard(block, mesh=acc.strategy.mesh)
fully_shard(meta, mesh=acc.strategy.mesh)
fsdp2_load_full_state_dict(acc, meta, make_model(5).state_dict() if acc.is_main_process else {})
results["load_full_meta"] = same_forward(meta, 5)

# load_checkpoint_in_model into the sharded model, from a safetensors file
path = os.path.join(out_dir, "weights.safetensors")
if acc.is_main_process:
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in make_model(6).state_dict().items()}, path, metadata={"format": "pt"})
acc.wait_for_everyone()
load_checkpoint_in_model(model, path)
results["checkpoint_in_model"] = same_forward(model, 6)
model.reshard()  # the root keeps its gathered parameters after a forward
with torch.no_grad():
    for p in model.parameters():
        p.to_local().zero_()
load_checkpoint_in_model(model, path, broadcast_from_rank0=True)  # only the main process reads
results["checkpoint_broadcast"] = same_forward(model, 6)

# copy_tensor_to_devices: the main process's tensor, the other passes None
given = torch.arange(6.0).reshape(2, 3) if acc.is_main_process else None
copied = copy_tensor_to_devices(given)
results["copied"] = copied.tolist()
results["copied_dtype"] = str(copied.dtype)

# avg_losses_across_data_parallel_group: each loss averaged over the processes
rank = acc.process_index
results["avg_losses"] = avg_losses_across_data_parallel_group(
    [torch.tensor(float(rank + 1)), torch.tensor(10.0 * (rank + 1))]
).tolist()

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
