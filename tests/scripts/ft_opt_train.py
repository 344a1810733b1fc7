"""One replica group of a DiLoCo run with torchft's options (tests/test_fault_tolerance_options.py).

Started by ``hasten launch --ft_replica_group G --ft_num_replica_groups 2 --ft_lighthouse URL``;
argv: OUT LOCAL_STEPS. Trains Linear(8, 4) with SGD (lr 0.05) on the fixed dataset of
tests/scripts/ft_train.py (64 samples, batches of 4, group G reading batches 2k+G) with
``FaultToleranceKwargs(semi_sync="diloco", init_sync=False, min_replicas=2, ...)``, the options
from the environment: FT_OPT_SYNC_EVERY, FT_OPT_FRAGMENTS, FT_OPT_DELAY (fragment_sync_delay);
FT_OPT_SAVE_AT: local steps (1-based, comma-separated) after which it calls save_state(OUT/ckpt).
Writes OUT/group{G}.json: the committed step and the weights after each local step, and each
save's outcome ("ok" or the ValueError's message).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from hasten import Accelerator, FaultToleranceKwargs

out, total = sys.argv[1], int(sys.argv[2])
group = int(os.environ["HASTEN_FT_REPLICA_GROUP"])

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

handler = FaultToleranceKwargs(
    min_replicas=2,
    init_sync=False,
    semi_sync="diloco",
    sync_every=int(os.environ["FT_OPT_SYNC_EVERY"]),
    fragments=int(os.environ["FT_OPT_FRAGMENTS"]),
    fragment_sync_delay=int(os.environ["FT_OPT_DELAY"]),
)
accelerator = Accelerator(kwargs_handlers=[handler])
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)


def weights() -> list[float]:
    inner = accelerator.unwrap_model(model)
    return torch.cat([inner.weight.detach().flatten(), inner.bias.detach().flatten()]).tolist()


save_at = {int(n) for n in os.environ.get("FT_OPT_SAVE_AT", "").split(",") if n}
steps, trace, saves = [], [], []
while len(steps) < total:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(accelerator.step)
        trace.append(weights())
        if len(steps) in save_at:
            try:
                accelerator.save_state(os.path.join(out, "ckpt"))
                saves.append([len(steps), "ok"])
            except ValueError as e:
                saves.append([len(steps), str(e)])
        if len(steps) == total:
            break

with open(os.path.join(out, f"group{group}.json"), "w") as f:
    json.dump({"steps": steps, "trace": trace, "saves": saves}, f)
