"""Run by 2 processes: crafted and damaged copies of an FSDP2 ("dcp") checkpoint are refused by
every process, nothing in them runs, nothing is restored (issue 38).

usage: trust_dcp.py OUT_DIR

Saves a checkpoint (model and AdamW after one step), then rank 0 makes the copies; each
process loads each copy and writes OUT_DIR/rank{R}.json: {case: {"error", "marker",
"unchanged"}} and whether the untouched checkpoint still loads. Last, every process loads the
copy whose .metadata has a flipped byte (its checksum recomputed) without catching the error:
the launcher's report of it is what the test reads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import make_model  # noqa: E402
from trust_common import craft_item, craft_metadata, damage_metadata  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

out = sys.argv[1]
acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
model, opt = acc.prepare(model, opt)
acc.backward(model(torch.randn(4, 8)).sum())
opt.step()
good = acc.save_state(os.path.join(out, "good"))
saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
moved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
lr = opt.param_groups[0]["lr"]

CASES = {  # name -> (tamper, load_state keywords)
    "metadata_payload": (lambda ck, m: craft_metadata(ck, m), {}),
    "metadata_payload_unverified": (lambda ck, m: craft_metadata(ck, m), {"verify_checksums": False}),
    "item_payload": (lambda ck, m: craft_item(ck, m), {}),
    "metadata_flip": (lambda ck, m: damage_metadata(ck), {}),
    "metadata_flip_recomputed": (lambda ck, m: damage_metadata(ck, recompute=True), {}),
    "metadata_flip_unverified": (lambda ck, m: damage_metadata(ck), {"verify_checksums": False}),
}
if acc.is_main_process:
    for name, (tamper, _) in CASES.items():
        shutil.copytree(good, os.path.join(out, name))
        tamper(os.path.join(out, name), os.path.join(out, f"marker_{name}"))
acc.wait_for_everyone()

results: dict = {}
for name, (_, kwargs) in CASES.items():
    try:
        acc.load_state(os.path.join(out, name), **kwargs)
        error = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        error = f"{type(e).__name__}: {e}"
    acc.wait_for_everyone()  # every process's payload (if any ran) has run
    now = {k: v.to_local() for k, v in model.state_dict().items()}
    results[name] = {
        "error": error,
        "marker": os.path.exists(os.path.join(out, f"marker_{name}")),
        "unchanged": all(torch.equal(moved[k], now[k]) for k in moved) and opt.param_groups[0]["lr"] == lr,
    }
acc.load_state(good)  # the untouched checkpoint loads, optimizer param_groups included
results["good_loads"] = all(torch.equal(saved[k], v.to_local()) for k, v in model.state_dict().items())
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(results, f)
acc.load_state(os.path.join(out, "metadata_flip_recomputed"))  # not caught: what the launcher reports
