"""Row 8: FSDP2 on 2 gloo processes, a ~50M-parameter model with AdamW. Run under
``python -m torch.distributed.run --nproc_per_node 2``.

- bytes per rank of parameters + gradients + optimizer state after a step, hasten FSDP2 ÷
  hasten DDP (counted from the tensors each rank holds: local shards for FSDP2);
- peak RSS per rank (``--variant fsdp`` / ``--variant ddp``: a process pair that builds and
  steps that one variant only and reports its peak RSS), FSDP2 ÷ DDP;
- step time, hasten FSDP2 ÷ a hand-written ``fully_shard`` loop with the same wrapping
  (per-block, then root), interleaved (see _harness), samples/s being its inverse.
Accelerate's FSDP2 falls back to DDP on a CPU-only machine, so it has no column here.
Rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist
from torch import nn

from _harness import emit, interleave_steps, ratio_summary, single_thread

WIDTH, BLOCKS, BATCH = 1024, 6, 8  # 6 x (2 x 4 x 1024 x 1024) ~ 50M parameters (--width: smaller, smoke runs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


def make() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    def size(t):
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += size(p) + (size(p.grad) if p.grad is not None else 0)
    for state in opt.state.values():
        total += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    global WIDTH
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    parser.add_argument("--variant", choices=["both", "fsdp", "ddp"], default="both")
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    WIDTH = args.width
    single_thread()
    from hasten import Accelerator, FullyShardedDataParallelPlugin

    if args.variant != "both":
        plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]) if args.variant == "fsdp" else None
        one = Accelerator(fsdp_plugin=plugin)
        model = make()
        model, opt = one.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        for _ in range(2):
            loss = nn.functional.cross_entropy(model(torch.randn(BATCH, WIDTH)), torch.randint(0, 10, (BATCH,)))
            one.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
        peak = torch.tensor([rss_mb()])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            emit({"variant": args.variant, "peak_rss_mb": float(peak), "bytes": local_bytes(model, opt)}, args.out)
        return

    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0))
    y = torch.randint(0, 10, (BATCH,))

    def step(model, opt, backward):
        loss = nn.functional.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    fsdp = make()
    fsdp, fsdp_opt = acc.prepare(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-4))
    step(fsdp, fsdp_opt, acc.backward)
    fsdp_bytes = local_bytes(fsdp, fsdp_opt)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    raw = make()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in raw.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    step(raw, raw_opt, lambda loss: loss.backward())

    ddp_acc = Accelerator()
    ddp = make()
    ddp, ddp_opt = ddp_acc.prepare(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    step(ddp, ddp_opt, ddp_acc.backward)
    ddp_bytes = local_bytes(ddp, ddp_opt)

    def loop(model, opt, backward):
        def epoch():
            for _ in range(1000):
                step(model, opt, backward)
                yield None

        return epoch

    times = interleave_steps(
        {"raw_fully_shard": loop(raw, raw_opt, lambda loss: loss.backward()), "hasten_fsdp": loop(fsdp, fsdp_opt, acc.backward)},
        rounds=args.rounds, steps=args.steps, warmup=1,
    )
    if dist.get_rank() == 0:
        emit({
            "params": sum(p.numel() for p in make().parameters()),
            "bytes_fsdp": fsdp_bytes, "bytes_ddp": ddp_bytes, "bytes_ratio": fsdp_bytes / ddp_bytes,
            "step_vs_raw": ratio_summary(times, "raw_fully_shard", "hasten_fsdp"),
        }, args.out)


if __name__ == "__main__":
    main()
