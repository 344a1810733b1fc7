"""Run by 2 processes with FSDP2 (issue 57): an evaluation forward before training, as the Hugging
Face Trainer's ``evaluate()`` before ``train()`` does, then training; compared with the same
training without the evaluation. One JSON file per rank: OUT/rank{RANK}.json.

usage: round6_resume_eval_first.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin

out = sys.argv[1]
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
rank = acc.process_index
STEPS = 3


def model_() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def train(model, opt) -> dict:
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights = {k: v.tolist() for k, v in acc.get_state_dict(model).items()}
    return {"losses": losses, "weights": weights}


def evaluate(model) -> float:
    model.eval()
    with torch.no_grad():
        value = float(model(data(99)[0]).sum())
    model.train()
    return value


def plain() -> dict:
    model = model_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return train(model, opt)


def eval_first(how: str) -> dict:
    model = acc.prepare(model_())
    evaluated = evaluate(model)
    if how == "eval_with_grad":  # a forward outside no_grad, no backward
        model(data(98)[0]).sum()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "optimizer_alone":
        opt = acc.prepare(opt)
    else:
        model, opt = acc.prepare(model, opt)
    got = train(model, opt)
    got["evaluated"] = evaluated
    got["sharded"] = all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
    return got


results: dict = {}
for name, run in [
    ("plain", plain),
    ("model_and_optimizer", lambda: eval_first("model_and_optimizer")),
    ("optimizer_alone", lambda: eval_first("optimizer_alone")),
    ("eval_with_grad", lambda: eval_first("eval_with_grad")),
]:
    try:
        results[name] = run()
    except Exception as e:  # noqa: BLE001 - reported to the test
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
