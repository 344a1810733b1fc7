"""Run by 2 processes: the core multi-process checks, one JSON file of results per rank.

usage: core_checks.py OUT_DIR
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from core_common import make_accelerator, train  # noqa: E402

from hasten import (  # noqa: E402
    Accelerator,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    PartialState,
)

out_dir = sys.argv[1]
results: dict = {}

# The first Accelerator creates the group with an explicit timeout.
acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=77))])
state = PartialState()
results["facts"] = {
    "num_processes": acc.num_processes,
    "process_index": acc.process_index,
    "local_process_index": acc.local_process_index,
    "is_main_process": acc.is_main_process,
    "is_local_main_process": acc.is_local_main_process,
    "device": str(acc.device),
    "distributed_type": str(acc.distributed_type),
    "backend": dist.get_backend(),
    "partial_state_same": [state.num_processes, state.process_index] == [acc.num_processes, acc.process_index],
}
try:
    pg = dist.distributed_c10d._get_default_group()
    results["facts"]["timeout_s"] = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
except Exception as exc:  # noqa: BLE001 - private API; report what happened
    results["facts"]["timeout_s"] = repr(exc)

# ---- collectives
rank = acc.process_index
results["gather"] = acc.gather(torch.tensor([rank, rank * 10])).tolist()
results["gather_scalar"] = acc.gather(torch.tensor(float(rank))).tolist()
results["reduce_sum"] = acc.reduce(torch.tensor([rank + 1.0])).tolist()
results["reduce_mean"] = acc.reduce(torch.tensor([rank + 1.0]), "mean").tolist()
padded = acc.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1)
results["padded"] = acc.gather(padded).tolist()
results["gather_nested"] = {
    k: t.tolist() for k, t in acc.gather({"a": torch.tensor([rank]), "b": torch.tensor([2 * rank])}).items()
}


# ---- DDP kwargs reach the DDP object
def ddp_facts(handler):
    a = Accelerator(kwargs_handlers=[handler] if handler else None)
    m = a.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    return {
        "type": type(m).__name__,
        "bucket_bytes_cap": m.bucket_bytes_cap,
        "find_unused_parameters": m.find_unused_parameters,
        "broadcast_buffers": m.broadcast_buffers,
        "gradient_as_bucket_view": m.gradient_as_bucket_view,
        "static_graph": m.static_graph,
    }


results["ddp_default"] = ddp_facts(None)
results["ddp_custom"] = ddp_facts(
    DistributedDataParallelKwargs(
        bucket_cap_mb=10, find_unused_parameters=True, broadcast_buffers=False, gradient_as_bucket_view=True
    )
)


# ---- every hook x wrapper gives the gradients of plain DDP
def grads_with(handler: DistributedDataParallelKwargs, iters: int = 3, layers: int = 1):
    torch.manual_seed(0)
    deep = [m for _ in range(layers - 1) for m in (torch.nn.Linear(8, 8), torch.nn.ReLU())]
    model = torch.nn.Sequential(*deep, torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    a = Accelerator(kwargs_handlers=[handler])
    model = a.prepare(model)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    for _ in range(iters):  # PowerSGD compresses from its start_powerSGD_iter on
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
    hook_name = model._get_ddp_logging_data().get("comm_hook", "")
    results["buckets_of_deep_model" if layers > 1 else "buckets_of_model"] = len(
        model.reducer._get_zeros_like_grad_buckets()
    )
    return [p.grad.clone() for p in model.parameters()], hook_name


reference, _ = grads_with(DistributedDataParallelKwargs())
results["hooks"] = {}
for hook, wrapper in itertools.product(list(DDPCommunicationHookType), ["no", "fp16", "bf16"]):
    option = {}
    if hook.value in ("power_sgd", "batched_power_sgd"):
        # Full rank: the approximation is exact, so gradients must match plain DDP.
        # (batched PowerSGD views the 108-value bucket as an 11 x 11 matrix.)
        full_rank = 16 if hook.value == "power_sgd" else 11
        option = {"matrix_approximation_rank": full_rank, "start_powerSGD_iter": 2, "min_compression_rate": 0.01}
    try:
        grads, name = grads_with(
            DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper, comm_state_option=option)
        )
        worst = max(float(((g - r).abs() - (1e-2 + 1e-2 * r.abs())).max()) for g, r in zip(grads, reference))
        results["hooks"][f"{hook.value}+{wrapper}"] = {"excess": worst, "hook": name}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results["hooks"][f"{hook.value}+{wrapper}"] = {"error": repr(exc)}

# ---- PowerSGD over several DDP buckets: on gloo its chained collectives must keep one order
# (without it: "Received data size doesn't match", or a hang). A 288-byte cap puts each
# Linear(8, 8) (weight 256 B + bias 32 B) in a bucket of its own. Full rank: exact.
several = DistributedDataParallelKwargs(bucket_cap_mb=288 / 2**20)
reference_deep, _ = grads_with(several, iters=6, layers=4)
results["hooks_buckets"] = {}
for hook, wrapper in itertools.product(["power_sgd", "batched_power_sgd"], ["no", "fp16"]):
    option = {"matrix_approximation_rank": 9, "start_powerSGD_iter": 2, "min_compression_rate": 0.01}
    handler = DistributedDataParallelKwargs(
        bucket_cap_mb=several.bucket_cap_mb, comm_hook=hook, comm_wrapper=wrapper, comm_state_option=option
    )
    try:
        grads, name = grads_with(handler, iters=6, layers=4)
        results["hooks_buckets"][f"{hook}+{wrapper}"] = {
            "hook": name,
            "grads": [g.flatten().tolist() for g in grads],
            "reference": [r.flatten().tolist() for r in reference_deep],
        }
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results["hooks_buckets"][f"{hook}+{wrapper}"] = {"error": repr(exc)}


# ---- the strategy: unwrap_model behaves as on 1 process (autocast kept with keep_fp32_wrapper=True)
def unwrap_facts():
    a = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = a.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    seen = []
    inner = a.unwrap_model(model)
    inner[0].register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    inner(torch.randn(2, 4))
    bare = a.unwrap_model(model, keep_fp32_wrapper=False)
    bare(torch.randn(2, 4))
    model(torch.randn(2, 4))  # the prepared model after the autocast forward was removed
    return {
        "strategy": type(a.strategy).__name__,
        "wrapped": type(model).__name__,
        "unwrapped_is_user_module": type(inner).__name__ == "Sequential" and bare is inner,
        "dtypes": seen,
        "keys": sorted(a.get_state_dict(model)),
    }


results["unwrap"] = unwrap_facts()


# ---- torch.compile under DDP: compile(DDP(model)) (Dynamo splits at the buckets) == eager DDP
def compiled_grads(backend):
    a = Accelerator(dynamo_backend=backend)
    torch.manual_seed(0)
    model = a.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(8, 8, generator=g)
    outs = []
    for _ in range(2):
        model.zero_grad()
        out = model(x)
        a.backward(out.pow(2).mean())
        outs.append(out.detach().flatten().tolist())
    return {
        "type": type(model).__name__,
        "inner": type(a.unwrap_model(model)).__name__,
        "outs": outs,
        "grads": [p.grad.flatten().tolist() for p in a.unwrap_model(model).parameters()],
    }


results["compile"] = {"eager": compiled_grads(None), "aot_eager": compiled_grads("aot_eager")}

# ---- training on 2 processes equals training on 1 process with the same global batches
for mp in ("no", "bf16", "fp16"):
    weights, losses = train(make_accelerator(mp), batch_size=8)
    results[f"train_{mp}"] = {"weights": weights, "losses": losses}

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
