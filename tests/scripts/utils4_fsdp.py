"""Run by 2 processes: Accelerate's FSDP checkpoint functions (hasten.utils.fsdp_utils) on FSDP2.

usage: utils4_fsdp.py OUT_DIR

A model sharded over the 2 processes trains two steps; its weights and optimizer are saved in each
layout (full, sharded with DCP, sharded one file per process), scrambled, loaded back, and
compared with what they were; the DCP folder is merged with merge_fsdp_weights. Each rank writes
OUT_DIR/rank{RANK}.json (read by tests/test_utils_round4_models.py).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.utils.fsdp_utils import (  # noqa: E402
    load_fsdp_model,
    load_fsdp_optimizer,
    merge_fsdp_weights,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from hasten.utils.modeling import model_has_dtensor  # noqa: E402

out_dir = sys.argv[1]
results: dict = {}

acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
model = acc.prepare(make_model())
opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
for x, y in batches(2, size=8):
    acc.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()
results["has_dtensor"] = model_has_dtensor(model)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def weights_now() -> dict[str, torch.Tensor]:
    return {n: local(p) for n, p in model.named_parameters()}


def optimizer_now() -> list[torch.Tensor]:
    inner = opt.optimizer
    return [local(v) for g in inner.param_groups for p in g["params"] for _, v in sorted(inner.state[p].items())]


def scramble() -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0).add_(3.0)
        for state in opt.optimizer.state.values():
            for v in state.values():
                v.zero_()


full_weights = {k: v.clone() for k, v in acc.get_state_dict(model).items()}  # gathered on the main process
weights, moments = weights_now(), optimizer_now()
CASES = {
    "full": ("FULL_STATE_DICT", True),
    "dcp": ("SHARDED_STATE_DICT", True),
    "per_rank": ("SHARDED_STATE_DICT", False),
}
for case, (kind, use_dcp) in CASES.items():
    plugin = FullyShardedDataParallelPlugin(state_dict_type=kind)
    folder = os.path.join(out_dir, case)
    save_fsdp_model(plugin, acc, model, folder, use_dcp=use_dcp)
    save_fsdp_optimizer(plugin, acc, opt, model, folder, use_dcp=use_dcp)
    acc.wait_for_everyone()
    scramble()
    changed = not torch.equal(next(iter(weights_now().values())), next(iter(weights.values())))
    loaded = load_fsdp_model(plugin, acc, model, folder, use_dcp=use_dcp)
    load_fsdp_optimizer(plugin, acc, opt, model, folder, use_dcp=use_dcp)
    results[case] = {
        "files": sorted(os.listdir(folder)),
        "scrambled": changed,
        "missing": list(loaded.missing_keys),
        "model_ok": all(torch.equal(a, weights[n]) for n, a in weights_now().items()),
        "optimizer_ok": len(optimizer_now()) == len(moments)
        and all(torch.equal(a, b) for a, b in zip(optimizer_now(), moments)),
    }

merged = os.path.join(out_dir, "merged")
merge_fsdp_weights(os.path.join(out_dir, "dcp", "pytorch_model_fsdp_0"), merged)  # every rank calls it
if acc.is_main_process:
    from safetensors.torch import load_file

    got = load_file(os.path.join(merged, "model.safetensors"))
    results["merged_ok"] = sorted(got) == sorted(full_weights) and all(
        torch.equal(got[k], full_weights[k]) for k in got
    )
    on_disk = torch.load(os.path.join(out_dir, "full", "pytorch_model_fsdp.bin"), weights_only=True)
    results["full_file_ok"] = sorted(on_disk) == sorted(full_weights) and all(
        torch.equal(on_disk[k], full_weights[k]) for k in on_disk
    )
# training goes on after the loads
x, y = batches(1, size=8, seed=5)[0]
acc.backward(nn.functional.cross_entropy(model(x), y))
opt.step()
results["trains_after"] = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(results, f)
acc.end_training()
