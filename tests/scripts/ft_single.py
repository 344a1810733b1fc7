"""One replica group alone, with a lighthouse of its own (tests/test_fault_tolerance.py's fast test).

Started by ``hasten launch --num_processes 1 --ft_replica_group 1 --ft_num_replica_groups 2`` (no
--ft_lighthouse: the lighthouse is started here and named in TORCHFT_LIGHTHOUSE, torchft's own
variable). Saves OUT/ckpt0 before the first step (the save starts the first quorum), trains as
ft_train.py does, for STEPS steps (the loop steps before it zeroes, so the first quorum would
start in the first gradient reduction), saves OUT/ckpt and loads it back as group 0, which it
lacks; writes OUT/single.json: the committed step after each step, the final weights, the
samples read, the strategy and the optimizer's commit gate, the replica groups and writer of
OUT/ckpt's fault_tolerance_groups_0.pt, the warnings of that load and the batch read after it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import torch
from torchft.coordination import LighthouseServer

from hasten import Accelerator, FaultToleranceKwargs

out, steps = sys.argv[1], int(sys.argv[2])
lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(64)), batch_size=4)

accelerator = Accelerator(kwargs_handlers=[FaultToleranceKwargs(min_replicas=1)])
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
accelerator.save_state(os.path.join(out, "ckpt0"))
committed, seen = [], []
for xb, yb, ib in loader:
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    committed.append(accelerator.step)
    seen.extend(ib.tolist())
    if len(committed) == steps:
        break
inner = accelerator.unwrap_model(model)
final = torch.cat([inner.weight.detach().flatten(), inner.bias.detach().flatten()]).tolist()
accelerator.save_state(os.path.join(out, "ckpt"))
groups = torch.load(os.path.join(out, "ckpt", "fault_tolerance_groups_0.pt"), weights_only=True)
ft = accelerator._fault_tolerance
handler = ft.handler
ft.handler = dataclasses.replace(handler, replica_group=0)  # a group the folder lacks
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    accelerator.load_state(os.path.join(out, "ckpt"))
ft.handler = handler
result = {
    "steps": committed,
    "final": final,
    "seen": seen,
    "strategy": type(accelerator.strategy).__name__,
    "gate": type(optimizer.optimizer).__name__,
    "saved_groups": sorted(groups["groups"]),
    "writer": groups["writer"],
    "warnings": [str(w.message) for w in caught],
    "next": next(iter(loader))[2].tolist(),  # group 1's position, which group 0 continues
}
with open(os.path.join(out, "single.json"), "w") as f:
    json.dump(result, f)
lighthouse.shutdown()
