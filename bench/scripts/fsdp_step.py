"""Row 9: FSDP2 step time, hasten ÷ the hand-written ``fully_shard`` loop with the same wrapping
(each Block, then the root), row 8's ~50M-parameter model with AdamW on 2 gloo processes.
Run under ``python -m torch.distributed.run --nproc_per_node 2``.

Three models in one process group, the same weights: ``hand`` (fsdp_memory.hand_shard, AdamW
built on the shards), ``hand_again`` (an identical copy: the A/A control) and ``hasten``
(``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))``,
``prepare(model, AdamW(...))``, ``accelerator.backward``). Each step is ``zero_grad()``, forward,
cross-entropy, backward, ``step()``, the same for all three; the loops are interleaved in
blocks (see _harness.interleave_steps) and each round's ratio is the block medians' ratio.
Both ranks time the same blocks (every step is collective); rank 0's figures are reported.
Samples/s is the inverse of the step ratio. Rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_memory  # noqa: E402  (the model, its builder and the hand-written sharding)
from _harness import emit, interleave_steps, ratio_summary, single_thread  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--width", type=int, default=1024, help="1024: ~50M parameters")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    args = parser.parse_args()
    fsdp_memory.WIDTH = args.width
    single_thread()
    from torch.distributed.device_mesh import init_device_mesh

    from hasten import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(fsdp_memory.BATCH, args.width, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (fsdp_memory.BATCH,), generator=torch.Generator().manual_seed(rank))

    def loop(model, opt, backward):
        def epoch():
            for _ in range(1000):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                backward(loss)
                opt.step()
                yield None

        return epoch

    loops = {}
    for name in ("hand", "hand_again"):
        model = fsdp_memory.hand_shard(fsdp_memory.make(), mesh)
        loops[name] = loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Tensor.backward)
    model = fsdp_memory.make()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    loops["hasten"] = loop(model, opt, acc.backward)
    times = interleave_steps(loops, rounds=args.rounds, steps=args.steps, warmup=1)
    if rank == 0:
        emit(
            {
                "params": fsdp_memory.params_at(args.width),
                "rounds": args.rounds,
                "steps_per_block": args.steps,
                "hand_step_s": sorted(times["hand"])[len(times["hand"]) // 2],
                "step_vs_hand": ratio_summary(times, "hand", "hasten"),
                "hand_again": ratio_summary(times, "hand", "hand_again"),
            },
            args.out,
        )


if __name__ == "__main__":
    main()
