"""Expert parallelism on 4 gloo processes (an MoE of 8 experts, top-2): hasten's ep ÷ a
hand-written all-to-all + grouped matmul, the experts' gathered weights per process ÷ without ep,
and the bytes the dispatch moves per step beside the theory.

Row 17 of ``bench/run.py``; alone, ``python moe_ep.py --out result.json`` (``--quick`` for a smoke
run). It starts ``python -m torch.distributed.run --nproc_per_node 4 moe_ep.py --part worker``, where:

- the model: an embedding, ``--layers`` blocks (a router ``Linear(H, 8)``, top-2 softmax weights,
  experts in transformers' layout ``gate_up_proj [8, 2I, H]``, ``down_proj [8, H, I]``, SiLU, a
  residual) and a head; the loss is cross-entropy on random tokens.
- ``hasten_ep4`` / ``hasten_ep2`` / ``hasten_fsdp``: ``ParallelismConfig(dp_shard_size=4,
  ep_size=4 | 2 | 1)``, FSDP on each block, SGD. At ep 4 (efsdp 1) FSDP leaves the experts out and
  they run as ``torch._grouped_mm`` where it runs (the CPU in fp32 here); ``hasten_ep4_loop`` is
  ep 4 with hasten's loop over the local experts instead, the like-for-like figure beside the
  hand loop's.
- ``hand``: the same model with each process's 2 experts as plain parameters (slices of the
  same weights), the other parameters under ``fully_shard`` over the 4 processes; the experts'
  forward sorts the (token, k) pairs by expert, exchanges the counts, then the tokens with
  ``torch.distributed.nn.functional.all_to_all_single`` (autograd), loops over its 2 experts,
  sends the results back, weights and sums them; the experts' gradients are divided by 4 (each
  expert's gradient is summed over the 4 data ranks' tokens). ``hand_grouped``: the same with one
  ``torch._grouped_mm`` per weight matrix instead of the loop over its experts (the issue's
  baseline, beside hasten's ep 4); ``hand`` is the baseline of ``hasten_ep4_loop``.

Step time: the six loops interleaved (``_harness.interleave_steps``), each step forward,
backward, ``optimizer.step()``, ``zero_grad()``; hasten ÷ hand per round. Then the same again
timed by rank 0's CPU time (``time.process_time``): four processes on a shared 2-core machine
wait for a core more than they compute, and the CPU time per step is what each implementation
costs, less the scheduler's noise. Memory: the bytes of
expert weights a process holds while its experts run (the gathered weights), read in the
experts' forward. Bytes: what each process's ``all_to_all_single`` calls send to the other
processes in one step (counted by a wrapper), beside the theory for an even routing: each layer
sends T x K x H x 4 bytes x (ep - 1) / ep four times (dispatch and combine, forward and
backward), T tokens, K = 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
E, K, V = 8, 2, 256


def build(args):  # noqa: ANN001, ANN201
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * args.inner, args.hidden) * 0.05)
            self.down_proj = nn.Parameter(torch.randn(E, args.hidden, args.inner) * 0.05)
            self.act_fn = nn.SiLU()

        def forward(self, x, index, weights):  # noqa: ANN001, ANN202 (only used without ep: never timed)
            out = torch.zeros_like(x)
            for e in range(E):
                token, slot = torch.where(index == e)
                gate, up = nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                out.index_add_(0, token, y * weights[token, slot, None])
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.experts = nn.Linear(args.hidden, E, bias=False), Experts()

        def forward(self, h):  # noqa: ANN001, ANN202
            flat = h.reshape(-1, h.shape[-1])
            weights, index = self.router(flat).softmax(-1).topk(K, dim=-1)
            return h + self.experts(flat, index, weights).view_as(h)

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(V, args.hidden)
            self.blocks = nn.ModuleList([Block() for _ in range(args.layers)])
            self.head = nn.Linear(args.hidden, V)

        def forward(self, ids):  # noqa: ANN001, ANN202
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    return MoE, Block


def hand_experts_forward(ep_rank: int, ep: int, grouped: bool = False):  # noqa: ANN201
    """The hand-written expert-parallel forward (the baseline), over the whole world: its local
    experts as a loop of linears, or (``grouped``) one ``torch._grouped_mm`` per weight matrix."""
    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single
    from torch.nn.functional import linear as nn_linear

    local = E // ep

    def forward(self, x, index, weights):  # noqa: ANN001, ANN202
        tokens = x.shape[0]
        pairs = index.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=E)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        got = got.view(ep, local)
        send, recv = counts.view(ep, local).sum(1).tolist(), got.sum(1).tolist()
        xs = all_to_all_single(torch.empty(sum(recv), x.shape[1]), x[order // K], recv, send)
        expert_of = torch.arange(ep * local).repeat_interleave(got.reshape(-1)) % local
        by_expert = torch.argsort(expert_of, stable=True)
        if grouped:
            ends = torch.cumsum(got.sum(0), 0, dtype=torch.int32)
            h = torch._grouped_mm(xs[by_expert], self.gate_up_proj.transpose(-2, -1), offs=ends)
            gate, up = h.chunk(2, dim=-1)
            ys = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=ends)
            back = all_to_all_single(torch.empty(sum(send), ys.shape[1]), ys[torch.argsort(by_expert)], send, recv)
            return (back[torch.argsort(order)].view(tokens, K, -1) * weights.unsqueeze(-1)).sum(1)
        parts, start = [], 0
        for e, n in enumerate(got.sum(0).tolist()):
            rows = xs[by_expert[start : start + n]]
            gate, up = nn_linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            parts.append(nn_linear(self.act_fn(gate) * up, self.down_proj[e]))
            start += n
        ys = torch.cat(parts)[torch.argsort(by_expert)]
        back = all_to_all_single(torch.empty(sum(send), ys.shape[1]), ys, send, recv)
        return (back[torch.argsort(order)].view(tokens, K, -1) * weights.unsqueeze(-1)).sum(1)

    return forward


def worker(args) -> None:  # noqa: ANN001
    import types

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import _harness

    from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from hasten.strategies import expert_parallel

    _harness.single_thread()
    MoE, _ = build(args)
    sent = {"bytes": 0}
    plain_a2a = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):  # noqa: A002, ANN001, ANN202
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        splits = input_split_sizes or [input.shape[0] // world] * world
        sent["bytes"] += sum(n for r, n in enumerate(splits) if r != rank) * row
        return plain_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    gathered: dict[str, int] = {}

    kernels: dict[str, list[str]] = {}

    def hasten_loop(ep: int, loop_over_experts: bool = False):  # noqa: ANN202
        pc = ParallelismConfig(dp_shard_size=4, ep_size=ep)
        acc = Accelerator(parallelism_config=pc, fsdp_plugin=FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]))  # fmt: skip
        model = MoE()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = acc.prepare(model, opt)
        experts = acc.unwrap_model(model).blocks[0].experts
        name = f"ep{ep}" + ("_loop" if loop_over_experts else "")
        if loop_over_experts:  # the decision hasten takes once per (device, dtype), taken here
            for block in acc.unwrap_model(model).blocks:
                block.experts._hasten_ep.grouped[("cpu", torch.float32)] = False

        def note(module, _args):  # noqa: ANN001, ANN202
            gathered[name] = sum(expert_parallel._local(p).numel() * 4 for p in module.parameters())
            grouped = getattr(module, "_hasten_ep", None)
            if grouped is not None:
                kernels[name] = sorted(
                    f"{d}/{str(t).removeprefix('torch.')}: {'grouped_mm' if g else 'loop'}"
                    for (d, t), g in grouped.grouped.items()
                )

        experts.register_forward_pre_hook(note)
        return lambda: _loop(model, opt, acc)

    def hand_loop(grouped: bool = False):  # noqa: ANN202
        from torch.distributed.fsdp import fully_shard

        model, rank = MoE(), dist.get_rank()
        for block in model.blocks:
            ex = block.experts
            for name in ("gate_up_proj", "down_proj"):
                local = getattr(ex, name).detach()[rank * (E // 4) : (rank + 1) * (E // 4)].clone()
                setattr(ex, name, torch.nn.Parameter(local))
                getattr(ex, name).register_hook(lambda g: g / 4)
            ex.forward = types.MethodType(hand_experts_forward(rank, 4, grouped), ex)
            fully_shard(block.router)
        fully_shard(model.embed), fully_shard(model.head)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return lambda: _loop(model, opt, None)

    def _loop(model, opt, acc):  # noqa: ANN001, ANN202
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(10**9):
            loss = model(torch.randint(0, V, (args.batch, args.seq), generator=g))
            if acc is not None:
                acc.backward(loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            yield

    loops = {"hasten_ep4": hasten_loop(4), "hasten_ep4_loop": hasten_loop(4, loop_over_experts=True),
             "hasten_ep2": hasten_loop(2), "hasten_fsdp": hasten_loop(1)}  # fmt: skip
    loops["hand"] = hand_loop()  # after an Accelerator made the process group
    loops["hand_grouped"] = hand_loop(grouped=True)
    times = _harness.interleave_steps(loops, rounds=args.rounds, steps=args.steps)
    cpu = _harness.interleave_steps(loops, rounds=args.rounds, steps=args.steps, clock=time.process_time)
    dist.all_to_all_single = counting  # bytes of one step each
    per_step = {}
    for name in ("hasten_ep4", "hasten_ep2", "hand"):
        it, sent["bytes"] = loops[name](), 0
        next(it)
        per_step[name] = sent["bytes"]
    dist.all_to_all_single = plain_a2a
    tokens = args.batch * args.seq
    theory = {f"ep{ep}": args.layers * 4 * tokens * K * args.hidden * 4 * (ep - 1) / ep for ep in (4, 2)}
    if dist.get_rank() == 0:
        result = {
            "step_ratio_ep4_vs_hand": _harness.ratio_summary(times, "hand", "hasten_ep4"),
            "step_ratio_ep4_loop_vs_hand": _harness.ratio_summary(times, "hand", "hasten_ep4_loop"),
            "step_ratio_ep4_vs_hand_grouped": _harness.ratio_summary(times, "hand_grouped", "hasten_ep4"),
            "step_ratio_ep2_vs_hand": _harness.ratio_summary(times, "hand", "hasten_ep2"),
            "step_ratio_fsdp_vs_hand": _harness.ratio_summary(times, "hand", "hasten_fsdp"),
            "gathered_expert_bytes": gathered,
            "gathered_ratio_ep4": gathered["ep4"] / gathered["ep1"],
            "gathered_ratio_ep2": gathered["ep2"] / gathered["ep1"],
            "dispatch_bytes_per_step_rank0": per_step,
            "dispatch_bytes_theory_even_routing": theory,
            "step_s": {name: _harness.summary(t) for name, t in times.items()},
            "cpu_ratio_ep4_vs_hand": _harness.ratio_summary(cpu, "hand", "hasten_ep4"),
            "cpu_ratio_ep4_loop_vs_hand": _harness.ratio_summary(cpu, "hand", "hasten_ep4_loop"),
            "cpu_ratio_ep4_vs_hand_grouped": _harness.ratio_summary(cpu, "hand_grouped", "hasten_ep4"),
            "cpu_step_s": {name: _harness.summary(t) for name, t in cpu.items()},
            "kernels": kernels,
            "config": {"experts": E, "top_k": K, "layers": args.layers, "hidden": args.hidden, "inner": args.inner,
                       "tokens_per_process": tokens, "processes": 4, "rounds": args.rounds, "steps": args.steps},
        }  # fmt: skip
        _harness.emit(result, args.out)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="driver", choices=("driver", "worker"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-others", action="store_true", help="accepted for bench/run.py; nothing else is compared")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inner", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.part == "worker":
        worker(args)
        return
    out = args.out or tempfile.mktemp(suffix=".json")
    sizes = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "inner", "batch", "seq", "rounds", "steps")]
    if args.quick:
        sizes += ["--rounds", "2", "--steps", "2", "--hidden", "32", "--inner", "64", "--seq", "16"]
    with socket.socket() as sock:  # a free port: other launches may hold torch's default one
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", port, __file__, "--part", "worker", "--out", out, *sizes]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)
    print(json.dumps(json.loads(Path(out).read_text()), indent=1))


if __name__ == "__main__":
    main()
