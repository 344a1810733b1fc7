"""One replica group of a fault-tolerant run (tests/test_fault_tolerance.py).

Started by ``hasten launch --ft_replica_group G --ft_num_replica_groups K --ft_lighthouse URL``;
argv: OUT TOTAL_STEPS TAG [SLEEP_S]. Trains Linear(8, 4) with SGD on a fixed dataset, the loop
an ordinary one, until ``accelerator.step`` (the committed step) reaches TOTAL_STEPS (0: the
number the test writes into OUT/target when it wants the run to end; none yet, go on). Writes
OUT/progress{G}.txt (the committed step, after each step) and, at the end,
OUT/group{G}_{TAG}.json (rank r > 0 of the group: ..._rank{r}.json): the committed step after
each step, the weights at each committed step, the weights at the end, the samples it read.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hasten import Accelerator, FaultToleranceKwargs

out, total, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
group = int(os.environ["HASTEN_FT_REPLICA_GROUP"])

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
index = torch.arange(64)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, index), batch_size=4)

init_sync = os.environ.get("FT_TEST_INIT_SYNC", "1") == "1"
semi_sync = os.environ.get("FT_TEST_SEMI_SYNC") or None  # "local_sgd": accelerator.step counts the syncs
handler = FaultToleranceKwargs(min_replicas=1, init_sync=init_sync, semi_sync=semi_sync, sync_every=4)
accelerator = Accelerator(kwargs_handlers=[handler])
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)


def weights() -> list[float]:
    inner = accelerator.unwrap_model(model)
    return torch.cat([inner.weight.detach().flatten(), inner.bias.detach().flatten()]).tolist()


def target() -> float:
    if total:
        return total
    try:
        with open(os.path.join(out, "target")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


steps, by_step, seen = [], {}, []
start = time.time()
while accelerator.step < target():
    for xb, yb, ib in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(accelerator.step)
        by_step[accelerator.step] = weights()
        seen.extend(ib.tolist())
        if accelerator.is_main_process:
            with open(os.path.join(out, f"progress{group}.tmp"), "w") as f:
                f.write(str(accelerator.step))
            os.replace(os.path.join(out, f"progress{group}.tmp"), os.path.join(out, f"progress{group}.txt"))
        if pause:
            time.sleep(pause)
        if accelerator.step >= target():
            break

result = {"steps": steps, "by_step": by_step, "final": weights(), "seen": seen, "seconds": time.time() - start}
rank = f"_rank{accelerator.process_index}" if accelerator.process_index else ""
with open(os.path.join(out, f"group{group}_{tag}{rank}.json"), "w") as f:
    json.dump(result, f)
