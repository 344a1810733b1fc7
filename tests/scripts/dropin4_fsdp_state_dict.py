"""Run by 2 processes: where FSDP2's full state dicts are gathered, per the plugin's full configs
(read by tests/test_dropin_round4_optim.py).

usage: dropin4_fsdp_state_dict.py OUT_DIR

Each case trains the tiny model of fsdp_common for 2 steps with ``state_dict_type="FULL_STATE_DICT"``
and the case's ``FullStateDictConfig`` / ``FullOptimStateDictConfig``, then records on each
process what ``get_state_dict`` and the strategy's full optimizer state dict hold; the "ff" case
also saves with ``save_model`` and round-trips the full checkpoint layout.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model, reference_train  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

out_dir = sys.argv[1]
results: dict = {}
DATA = batches(2)
REF_LOSSES, _, REF_WEIGHTS = reference_train(DATA)
# (offload_to_cpu, rank0_only) of the model's config and of the optimizer's; None: no config given
CASES = {
    "default": (None, None),
    "ff": ((False, False), (False, False)),
    "tf": ((True, False), (True, True)),
    "ft": ((False, True), (True, False)),
}


def train(model_config, optim_config):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="FULL_STATE_DICT",
        state_dict_config=None if model_config is None else FullStateDictConfig(*model_config),
        optim_state_dict_config=None if optim_config is None else FullOptimStateDictConfig(*optim_config),
    )
    acc = Accelerator(fsdp_plugin=plugin)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    r, n = acc.process_index, acc.num_processes
    for x, y in DATA:
        loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return acc, model, opt


def record(full: dict, optim: dict) -> dict:
    entry: dict = {"keys": sorted(full), "devices": sorted({str(t.device) for t in full.values()})}
    if full:
        entry["weight_diff"] = max((full[k].float() - REF_WEIGHTS[k]).abs().max().item() for k in REF_WEIGHTS)
    state = optim.get("state", {})
    entry["optim_keys"] = sorted(state)
    # full optimizer state: each moment has its parameter's full shape
    entry["optim_full_shapes"] = all(list(s["exp_avg"].shape) == list(REF_WEIGHTS[k].shape) for k, s in state.items())
    entry["optim_sums"] = {k: s["exp_avg"].double().sum().item() for k, s in state.items()}
    return entry


def case(name, model_config, optim_config):
    acc, model, opt = train(model_config, optim_config)
    entry = record(acc.get_state_dict(model), acc.strategy.optimizer_state_dict(opt))
    entry["layout"] = acc.strategy.checkpoint_layout
    if name == "ff":
        entry.update(round_trips(acc, model, opt))
    results[name] = entry


def round_trips(acc, model, opt) -> dict:
    """save_model writes the full weights once; save_state / load_state in the full layout."""
    saved = [os.path.basename(f) for f in acc.save_model(model, os.path.join(out_dir, "model"))]
    checkpoint = os.path.join(out_dir, "state")
    acc.save_state(checkpoint)
    before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    x, y = DATA[0]
    r, n = acc.process_index, acc.num_processes
    acc.backward(nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]))
    opt.step()
    opt.zero_grad()
    acc.load_state(checkpoint)
    after = acc.get_state_dict(model)
    return {
        "saved": saved,
        "state_files": sorted(os.listdir(checkpoint)),
        "restored_diff": max((after[k] - before[k]).abs().max().item() for k in before),
    }


for name, (model_config, optim_config) in CASES.items():
    try:
        case(name, model_config, optim_config)
    except Exception:  # noqa: BLE001 - the test reports what failed
        results[name] = {"error": traceback.format_exc()}

rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
