"""Run by `hasten launch --use_fsdp --fsdp_cpu_ram_efficient_loading true` on 2 processes
(tests/test_fsdp_fits.py): transformers sees FSDP with CPU-RAM-efficient loading (the
variables hasten launch exports), and prepare gives every process its shards of the main
process's weights.

usage: fsdp_transformers.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from hasten import Accelerator

model_dir, out_dir = sys.argv[1], sys.argv[2]
acc = Accelerator()  # first: transformers also checks that the process group exists
from transformers.integrations import is_fsdp_enabled  # noqa: E402

fsdp_seen = is_fsdp_enabled()
model = AutoModelForCausalLM.from_pretrained(model_dir)
on_meta = all(p.is_meta for p in model.parameters())
model = acc.prepare(model)
tokens = torch.arange(12).reshape(2, 6) % 50
logits = model(tokens).logits
full = acc.get_state_dict(model)
entry = {
    "env": {k: os.environ.get(k) for k in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")},
    "built_on_meta": on_meta,
    "transformers_sees_fsdp": fsdp_seen,
    "distributed_type": str(acc.distributed_type),
    "logits_sum": logits.sum().item(),
}
if acc.is_main_process:
    reference = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    entry["weight_diff"] = max(
        (full[k].float() - reference[k].float()).abs().max().item() for k in full if k in reference
    )
    entry["keys_match"] = sorted(k for k in reference if k in full) == sorted(full)
with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(entry, f)
