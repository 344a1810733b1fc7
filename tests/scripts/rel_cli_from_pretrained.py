"""transformers' from_pretrained under `hasten launch --use_fsdp --fsdp_cpu_ram_efficient_loading true`.

The Accelerator comes first (transformers' is_fsdp_enabled() also needs the process group). Writes
OUT/rank{RANK}.json: the FSDP variables each rank saw, is_fsdp_enabled(), the device of every
parameter after from_pretrained, whether the loaded weights are the saved ones, and, after
prepare, whether this rank's shards are the shards of rank 0's loaded weights.

usage: rel_cli_from_pretrained.py OUT MODEL_DIR
"""

import json
import os
import sys

import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin

out, model_dir = sys.argv[1], sys.argv[2]
# The Accelerator's own check of a reshard group against the processes (hasten launch refuses the same)
try:
    Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=4))
    refused = None
except ValueError as err:
    refused = str(err)
accelerator = Accelerator(cpu=True)

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import is_fsdp_enabled  # noqa: E402

saved = load_file(os.path.join(model_dir, "model.safetensors"))
model = AutoModelForCausalLM.from_pretrained(model_dir)
devices = {name: p.device.type for name, p in model.named_parameters()}
loaded_equal = all(
    torch.equal(p, saved[name]) for name, p in model.named_parameters() if p.device.type != "meta" and name in saved
)
full = {k: v.clone() for k, v in model.state_dict().items()} if accelerator.is_main_process else None
model = accelerator.prepare(model)
gathered = accelerator.get_state_dict(model)  # every process takes part; the main one gets the weights
same_after_prepare = None
if accelerator.is_main_process:
    same_after_prepare = all(torch.equal(gathered[k], full[k]) for k in full if k in gathered)
record = {
    "rank": accelerator.process_index,
    "ACCELERATE_USE_FSDP": os.environ.get("ACCELERATE_USE_FSDP"),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING"),
    "is_fsdp_enabled": is_fsdp_enabled(),
    "strategy": type(accelerator.strategy).__name__ if hasattr(accelerator, "strategy") else None,
    "devices": devices,
    "loaded_equal": loaded_equal,
    "same_after_prepare": same_after_prepare,
    "refused": refused,
}
with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump(record, f)
