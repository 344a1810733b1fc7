"""One replica group of a fault-tolerant run with FSDP2 inside it (tests/test_fault_tolerance_fsdp.py).

Started by ``hasten launch --num_processes P --ft_replica_group G --ft_num_replica_groups K
--ft_lighthouse URL``; argv: OUT TOTAL_STEPS TAG [SLEEP_S]. Trains a two-layer MLP (each Linear an
FSDP unit; the last one, Linear(16, 3), shards unevenly over 2 processes) with Adam and gradient
clipping (``accelerator.clip_grad_norm_``, max norm 0.1) on a fixed dataset, until
``accelerator.step`` (the committed step) reaches TOTAL_STEPS (0: the number the test writes into
OUT/target). Writes OUT/progress{G}.txt (the committed step, rank 0) and, at the end,
OUT/group{G}_{TAG}_rank{R}.json: the strategy, the committed step after each step, this rank's
shards after each committed step (``by_step``), the samples it read, two numbers drawn from torch's
generator after each optimizer step (``draws``, by committed step), and on rank 0 the full weights at
the end (``final``, gathered) in ``named_parameters`` order.

Environment: FT_TEST_INIT_SYNC (0/1); FT_TEST_HSDP=1: ``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=P/2)`` instead of ``fsdp_plugin``; FT_TEST_FP16=1 with FT_TEST_INF_STEP=k: group 1
feeds an inf at its k-th step (``skipped`` and ``scales`` are then recorded); FT_TEST_ACCUMULATE=n:
``gradient_accumulation_steps=n``, each step ``accelerator.accumulate(model)`` over n batches (clipped
once they are synced); FT_TEST_SAVE_AT=k: ``save_state(OUT/ckpt)``, one folder for every group, once
the committed step is k, before ``zero_grad`` (a process whose group writes it touches
OUT/wrote{G}_{rank}, from a save pre-hook); FT_TEST_RESUME=1: ``load_state`` of it first (then
``healing_state``: whether the shards the strategy sends a rejoining group are still the model's
parameters, and read as they are); FT_TEST_OFFSET=1: group 1 (unless it resumes) skips its first
batch and draws one number first, so that its position and generator differ from group 0's.
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
accumulate = int(getenv("FT_TEST_ACCUMULATE", "1"))
accelerator = Accelerator(
    mixed_precision="fp16" if fp16 else "no", kwargs_handlers=[handler], gradient_accumulation_steps=accumulate,
    **sharding,
)  # fmt: skip
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
inf_step = int(getenv("FT_TEST_INF_STEP", "0")) if group == 1 else 0
checkpoint = os.path.join(out, "ckpt")
resume = getenv("FT_TEST_RESUME") == "1"
if resume:
    accelerator.load_state(checkpoint)
skip = group == 1 and getenv("FT_TEST_OFFSET") == "1" and not resume
if skip:
    torch.rand(1)
save_at = int(getenv("FT_TEST_SAVE_AT", "-1"))


def wrote(models, weights, folder) -> None:
    open(os.path.join(out, f"wrote{group}_{accelerator.process_index}"), "w").close()


accelerator.register_save_state_pre_hook(wrote)


def shards() -> list[float]:
    """This rank's local shards of every parameter, flattened."""
    return [v for p in model.parameters() for v in p.to_local().detach().flatten().tolist()]


def healing_state() -> bool:
    """Whether what the strategy would send a rejoining group now (its function torchft calls) is
    this model's parameters (the same tensors the strategy found, read as they are) and Adam's state."""
    inner = accelerator.unwrap_model(model)
    params = dict(inner.named_parameters())
    same = all(accelerator.strategy._shards[id(inner)].entries[n] is p for n, p in params.items())
    sent = accelerator._fault_tolerance.manager._user_state_dicts["hasten"]()
    [weights], [adam] = sent["models"], sent["optimizers"]
    equal = all(torch.equal(weights[n]["local"], p.to_local()) for n, p in params.items())
    moments = [s["exp_avg"] for s in optimizer.state_dict()["state"].values()]
    sent_moments = [s["exp_avg"]["local"] for s in adam["state"].values()]
    equal &= len(moments) == len(params) and all(map(torch.equal, sent_moments, [m.to_local() for m in moments]))
    return same and equal


def target() -> float:
    if total:
        return total
    try:
        with open(os.path.join(out, "target")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


steps, by_step, seen, skipped, scales, draws = [], {}, [], [], [], {}
healing = healing_state() if resume else None
while accelerator.step < target():
    for xb, yb, ib in loader:
        if skip:
            skip = False
            continue
        if inf_step and len(steps) + 1 == inf_step:
            xb = xb * float("inf")
        seen.extend(ib.tolist())
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if not accelerator.sync_gradients:
                continue
            draws[accelerator.step] = torch.rand(2).tolist()
            if accelerator.step == save_at:  # before zero_grad: no quorum started since the step
                accelerator.save_state(checkpoint)
                save_at = -1
            optimizer.zero_grad()
        steps.append(accelerator.step)
        by_step[accelerator.step] = shards()
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
    "steps": steps, "by_step": by_step, "seen": seen, "skipped": skipped, "scales": scales, "draws": draws,
    "healing_state": healing,
    "final": [v for n in names for v in full[n].flatten().tolist()] if full else None,
}  # fmt: skip
with open(os.path.join(out, f"group{group}_{tag}_rank{accelerator.process_index}.json"), "w") as f:
    json.dump(result, f)
