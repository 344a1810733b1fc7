"""fp8 (torchao float8, emulated on the CPU) under FSDP2 and TP x FSDP2; one JSON file per rank
(read by tests/test_fp8_distributed.py).

usage: fp8_checks.py OUT_DIR MODE [CHECKPOINT_DIR]
  one   plain python, one process: the reference losses (FSDP's plugin on one process shards nothing)
  ddp   2 processes: DistributedDataParallel over the float8 layers
  fsdp  2 processes: FSDP2 over both; saves the state and the weights to CHECKPOINT_DIR
  tp    4 processes: TP 2 x FSDP 2; then loads the 2-process state from CHECKPOINT_DIR (resharded)

The model has a unit whose own parameters are all float8 weights (``Bare``: gloo cannot all-gather
float8 bytes alone, so it gathers in high precision) and one with norms and biases too
(``Normed``: its weights are all-gathered in float8, with scales precomputed after each step).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch
from torch import nn

from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")
STEPS = 20
WIDTH = 32
BATCH = 8  # the global batch; each data-parallel rank takes its share


class Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([Bare(), Normed()])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 8, generator=g) / 4
    xs = [torch.randn(BATCH, 16, generator=g) for _ in range(STEPS)]
    return [(x, torch.tanh(x @ teacher)) for x in xs]


def accelerator(mode: str) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Bare", "Normed"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    if mode == "tp":
        plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
        config = ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=plan)
        return Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, parallelism_config=config)
    if mode == "ddp":
        return Accelerator(mixed_precision="fp8")
    return Accelerator(mixed_precision="fp8", fsdp_plugin=plugin)


def train(mode: str) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, dict]:
    acc = accelerator(mode)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    dp = {"one": 1, "ddp": 2, "fsdp": 2, "tp": 2}[mode]
    share = acc.process_index // (acc.num_processes // dp)  # TP ranks of one data rank share its batch
    precomputed = []
    opt.optimizer.register_step_post_hook(lambda *a: precomputed.append(1))  # after hasten's own hook
    losses = []
    for x, y in batches():
        n = BATCH // dp
        loss = nn.functional.mse_loss(model(x[share * n : (share + 1) * n]), y[share * n : (share + 1) * n])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    inner = acc.unwrap_model(model)
    kinds = {n: type(getattr(p, "_local_tensor", p)).__name__ for n, p in inner.named_parameters()}
    hooks = len(opt.optimizer._optimizer_step_post_hooks)
    return acc, model, opt, {"losses": losses, "kinds": kinds, "post_step_hooks": hooks, "steps": len(precomputed)}


def full(acc: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    ck = sys.argv[3] if len(sys.argv) > 3 else None
    rank = int(os.environ.get("RANK", 0))
    result: dict = {"mode": mode}
    try:
        acc, model, opt, result["train"] = train(mode)
        plain = acc.get_state_dict(model)
        result["plain_types"] = sorted({type(t).__name__ for t in plain.values()})
        if mode == "fsdp":
            acc.save_state(os.path.join(ck, "state"))
            acc.save_model(model, os.path.join(ck, "weights"))
            if acc.is_main_process:
                torch.save({k: v.float() for k, v in plain.items()}, os.path.join(ck, "full.pt"))
            acc.wait_for_everyone()
        if mode == "tp":
            acc.load_state(os.path.join(ck, "state"))
            saved = torch.load(os.path.join(ck, "full.pt"))
            loaded = full(acc, model)
            if acc.is_main_process:
                result["resharded_equal"] = sorted(k for k in saved if torch.equal(saved[k], loaded[k]))
                result["resharded_keys"] = sorted(saved)
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
