"""One replica group of a fault-tolerant run with FSDP2 inside it (tests/test_fault_tolerance_fsdp.py).

Started by ``hasten launch --num_processes P --ft_replica_group G --ft_num_replica_groups K
--ft_lighthouse URL``; argv: OUT TOTAL_STEPS TAG [SLEEP_S]. Trains a two-layer MLP (each Linear an
FSDP unit; the last one, Linear(16, 3), shards unevenly over 2 processes) with Adam and gradient
clipping (``accelerator.clip_grad_norm_``, max norm 0.1) on a fixed dataset, until
``accelerator.step`` (the committed step) reaches TOTAL_STEPS (0: the number the test writes into
OUT/target). Writes OUT/progress{G}.txt (the committed step, rank 0) and, at the end,
OUT/group{G}_{TAG}_rank{R}.json: the strategy, the committed step after each step, this rank's
shards after each committed step (``by_step``), the samples it read, and on rank 0 the full weights
at the end (``final``, gathered) in ``named_parameters`` order.

Environment: FT_TEST_INIT_SYNC (0/1); FT_TEST_HSDP=1: ``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=P/2)`` instead of ``fsdp_plugin``; FT_TEST_FP16=1 with FT_TEST_INF_STEP=k: group 1
feeds an inf at its k-th step (``skipped`` and ``scales`` are then recorded).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hasten import Accelerator, FaultToleranceKwargs, FullyShardedDataParallelPlugin, ParallelismConfig

out, total, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
group = int(os.environ["HASTEN_FT_REPLICA_GROUP"])
getenv = os.environ.get

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 3, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(64)), batch_size=4)

handler = FaultToleranceKwargs(min_replicas=1, init_sync=getenv("FT_TEST_INIT_SYNC", "1") == "1")
fp16 = getenv("FT_TEST_FP16") == "1"
sharding: dict = {"fsdp_plugin": FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])}
if getenv("FT_TEST_HSDP") == "1":
    processes = int(os.environ["WORLD_SIZE"])
    sharding = {"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=processes // 2)}
accelerator = Accelerator(mixed_precision="fp16" if fp16 else "no", kwargs_handlers=[handler], **sharding)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
inf_step = int(getenv("FT_TEST_INF_STEP", "0")) if group == 1 else 0


def shards() -> list[float]:
    """This rank's local shards of every parameter, flattened."""
    return [v for p in model.parameters() for v in p.to_local().detach().flatten().tolist()]


def target() -> float:
    if total:
        return total
    try:
        with open(os.path.join(out, "target")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


steps, by_step, seen, skipped, scales = [], {}, [], [], []
while accelerator.step < target():
    for xb, yb, ib in loader:
        if inf_step and len(steps) + 1 == inf_step:
            xb = xb * float("inf")
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(accelerator.step)
        by_step[accelerator.step] = shards()
        seen.extend(ib.tolist())
        if fp16:
            skipped.append(accelerator.optimizer_step_was_skipped)
            scales.append(accelerator.scaler.get_scale())
        if accelerator.is_main_process:
            with open(os.path.join(out, f"progress{group}.tmp"), "w") as f:
                f.write(str(accelerator.step))
            os.replace(os.path.join(out, f"progress{group}.tmp"), os.path.join(out, f"progress{group}.txt"))
        if pause:
            time.sleep(pause)
        if accelerator.step >= target():
            break

full = accelerator.get_state_dict(model)  # gathered on rank 0
names = [n for n, _ in accelerator.unwrap_model(model).named_parameters()]
result = {
    "strategy": type(accelerator.strategy).__name__, "distributed_type": str(accelerator.distributed_type),
    "steps": steps, "by_step": by_step, "seen": seen, "skipped": skipped, "scales": scales,
    "final": [v for n in names for v in full[n].flatten().tolist()] if full else None,
}  # fmt: skip
with open(os.path.join(out, f"group{group}_{tag}_rank{accelerator.process_index}.json"), "w") as f:
    json.dump(result, f)
