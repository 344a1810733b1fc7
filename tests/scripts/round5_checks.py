"""Run by 2 processes (or 4 with ``four``): the fifth reliability round's checks of pipeline and
tensor parallelism (issue 48), one JSON file per rank (read by tests/test_reliability_pp.py).

usage: round5_checks.py OUT_DIR two|four

Every process seeds torch's global generator differently (as a script that never calls
``set_seed`` gets), so an order drawn from it would differ between the processes of one data group.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from pp_common import TP_PLAN, Llama, dataset, loss_fn  # noqa: E402

from hasten import Accelerator, DataLoaderConfiguration, ParallelismConfig  # noqa: E402
from hasten.strategies.pipeline_parallel.schedule import SCHEDULES_KEPT  # noqa: E402
from hasten.utils import TorchPipelineParallelConfig  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
results: dict = {}
B = 8


class Numbered(torch.utils.data.Dataset):
    """Sample i is (i, a random number drawn where the sample is loaded: in a worker, from its seed)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()))


def config(pp=1, t=1, r=1, s=1, **handler):
    return ParallelismConfig(
        pp_size=pp,
        tp_size=t,
        dp_replicate_size=r,
        dp_shard_size=s,
        tp_plan=TP_PLAN if t > 1 else None,
        pp_handler=TorchPipelineParallelConfig(**handler) if pp > 1 else None,
    )


def orders(pp=1, t=1, r=1, s=1):
    """Two epochs of a shuffled loader, without and with workers, after an unshared seed."""
    acc = Accelerator(parallelism_config=config(pp, t, r, s))
    torch.manual_seed(1000 + rank)  # no set_seed: every process's global generator differs
    got = {}
    for workers in (0, 2):
        loader = acc.prepare(torch.utils.data.DataLoader(Numbered(), batch_size=4, shuffle=True, num_workers=workers))
        epochs = []
        for _ in range(2):
            epochs.append([[int(i) for i in idx] + [round(float(x), 6) for x in rnd] for idx, rnd in loader])
        got[f"workers{workers}"] = epochs
    sequential = acc.prepare(torch.utils.data.DataLoader(Numbered(), batch_size=4, num_workers=2))
    got["sequential_workers"] = [round(float(x), 6) for _, rnd in sequential for x in rnd]
    got["dp_rank"] = acc.data_parallel_rank if hasattr(acc, "data_parallel_rank") else None
    got["dp"] = r * s
    return got


def pipeline_model(acc, model=None, opt_before=True, lr=1e-2):
    torch.manual_seed(0)
    model = model if model is not None else Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    return model, opt


def fp8_optimizer_before_prepare():
    """PP 2 + fp8, the optimizer built before prepare (the README's order): it holds only this
    stage's float8 weights, trains, saves and loads."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = Accelerator(parallelism_config=config(pp=2, schedule="1F1B", microbatches=4), mixed_precision="fp8")
        model, opt = pipeline_model(acc)
    part = acc.unwrap_model(model)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
    losses = []
    for step, (x, y) in enumerate(loader):
        losses.append(float(acc.pipeline_step(model, x, y, loss_fn)))
        opt.step()
        opt.zero_grad()
        if step == 1:
            break
    folder = os.path.join(out_dir, "fp8_pp2")
    acc.save_state(folder)
    before = {k: v.detach().float().clone() for k, v in part.state_dict().items()}
    acc.load_state(folder)
    after = {k: v.detach().float() for k, v in part.state_dict().items()}
    own = {id(p) for p in part.parameters()}
    held = [p for g in opt.optimizer.param_groups for p in g["params"]]
    return {
        "optimizer_params": len(held),
        "stage_params": len(own),
        "foreign": sum(id(p) not in own for p in held),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in part.modules()),
        "losses": losses,
        "reloaded_same": all(torch.equal(before[k], after[k]) for k in before),
    }


def schedule_cache():
    """More input shapes than SCHEDULES_KEPT: the cache stays bounded, every step still right."""
    acc = Accelerator(parallelism_config=config(pp=2, schedule="1F1B", microbatches=2))
    model, opt = pipeline_model(acc)
    torch.manual_seed(0)
    ref = Llama()
    lengths = list(range(2, 2 + SCHEDULES_KEPT + 4)) + [2, 3]  # the first shapes come back after eviction
    diffs = []
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n in lengths:
            x = torch.randint(16, (4, n), generator=g)
            y = torch.randint(16, (4, n), generator=g)
            loss = acc.pipeline_step(model, x, y, loss_fn)
            diffs.append(abs(float(loss) - float(loss_fn(ref(x), y))))
    return {"kept": len(model._schedules), "limit": SCHEDULES_KEPT, "max_diff": max(diffs), "steps": len(diffs)}


def weighted_loss(logits, targets):
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets["labels"].flatten(), reduction="none")
    w = targets["weights"].flatten()
    return (per_token * w).sum() / w.sum()


def dict_targets():
    """pipeline_step with a dict of targets (as the loss function takes them) trains as one process."""
    acc = Accelerator(parallelism_config=config(pp=2, schedule="GPipe", microbatches=4))
    model, opt = pipeline_model(acc)
    torch.manual_seed(0)
    ref = Llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for x, y in list(torch.utils.data.DataLoader(dataset(), batch_size=B))[:2]:
        targets = {"labels": y, "weights": torch.rand(y.shape, generator=g) + 0.5, "note": "kept as it is"}
        losses.append(float(acc.pipeline_step(model, x, targets, lambda o, t: weighted_loss(o, t))))
        opt.step()
        opt.zero_grad()
        # torch's microbatches: the mean of each microbatch's weighted loss
        loss = sum(weighted_loss(ref(xm), {"labels": ym, "weights": wm}) for xm, ym, wm in
                   zip(x.chunk(4), y.chunk(4), targets["weights"].chunk(4))) / 4  # fmt: skip
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    refused = {}
    for name, bad in (("short", {"labels": torch.zeros(3, 3)}), ("empty", {"note": 1})):
        try:
            acc.pipeline_step(model, x, bad, loss_fn)
            refused[name] = None
        except TypeError as e:
            refused[name] = str(e)
    return {"losses": losses, "ref_losses": ref_losses, "refused": refused}


class Relu(nn.Module):
    def forward(self, x):
        return F.relu(x)


class Chain(nn.Module):
    """The second stage holds no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), Relu()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def zero_param_stage():
    acc = Accelerator(parallelism_config=config(pp=2, schedule="GPipe", microbatches=2, split_points=["layers.1"]))
    model, opt = pipeline_model(acc, Chain())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        acc.pipeline_step(model, x, y, F.mse_loss)
        opt.step()
        opt.zero_grad()
    folder = os.path.join(out_dir, "zero_param")
    acc.save_state(folder)
    acc.load_state(folder)
    return {"stage_params": sum(1 for _ in acc.unwrap_model(model).parameters()), "saved": True}


def dispatch_refused():
    try:
        Accelerator(
            parallelism_config=config(pp=2), dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
        ).prepare(torch.utils.data.DataLoader(Numbered(), batch_size=4))
    except ValueError as e:
        return {"message": str(e)}
    return {"message": None}


def pp_tp_fp8():
    """PP 2 x TP 2 with fp8: the scales of the TP-split and the unsplit float8 weights (two meshes)
    precomputed after each step; losses close to the same run without fp8."""
    got = {}
    for precision in ("no", "fp8"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = Accelerator(parallelism_config=config(pp=2, t=2, schedule="1F1B", microbatches=4),
                              mixed_precision=precision)  # fmt: skip
            model, opt = pipeline_model(acc)
        losses = []
        for step, (x, y) in enumerate(torch.utils.data.DataLoader(dataset(), batch_size=B)):
            losses.append(float(acc.pipeline_step(model, x, y, loss_fn)))
            opt.step()
            opt.zero_grad()
            if step == 2:
                break
        got[precision] = losses
        got[f"{precision}_float8_layers"] = sum(
            type(m).__name__ == "Float8Linear" for m in acc.unwrap_model(model).modules()
        )
    return got


def check(name, fn):
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - recorded, the test shows it
        results[name] = {"error": traceback.format_exc()}


if mode == "two":
    check("orders_pp2", lambda: orders(pp=2))
    check("orders_tp2", lambda: orders(t=2))
    check("orders_ddp2", lambda: orders(r=2))
    check("fp8_optimizer_before_prepare", fp8_optimizer_before_prepare)
    check("schedule_cache", schedule_cache)
    check("dict_targets", dict_targets)
    check("zero_param_stage", zero_param_stage)
    check("dispatch_refused", dispatch_refused)
else:
    check("orders_pp2_dp2", lambda: orders(pp=2, s=2))
    check("orders_tp2_dp2", lambda: orders(t=2, r=2))
    check("pp2_tp2_fp8", pp_tp_fp8)

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
