"""Row 12: N-D parallelism on 4 gloo processes, hasten ÷ the hand-written torch loop on the same
mesh, for FSDP 4, HSDP 2 × 2 and TP 2 × FSDP 2: memory per process and step time, and the bytes
that cross the replicate dim per step, HSDP ÷ FSDP.

Run as ``python nd_parallel.py`` (the driver). Every cell is a launch of its own,
``python -m torch.distributed.run --nproc_per_node 4 nd_parallel.py --part P --layout L``, run
with glibc told to hand freed memory back (``MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0
MALLOC_MMAP_THRESHOLD_=65536``), so RSS is live memory.

The model is row 8's (``fsdp_memory.Net``: Blocks of LayerNorm, ``up`` width -> 4 width,
``down`` back, then a head), built on the CPU on every rank with the same seed. The layouts:

- ``fsdp4``: a 1-D mesh ``("dp_shard",)`` of 4; hand: ``fully_shard`` each Block, then the root;
  hasten: ``ParallelismConfig(dp_shard_size=4)``;
- ``hsdp``: a 2-D mesh ``("dp_replicate", "dp_shard")`` of 2 × 2; hand: ``fully_shard(mesh=mesh)``
  (2-D: HSDP); hasten: ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``;
- ``tp_fsdp``: a 2-D mesh ``("dp_shard", "tp")`` of 2 × 2; hand: ``parallelize_module`` on each
  Block with ``up`` colwise and ``down`` rowwise on ``mesh["tp"]``, then ``fully_shard`` on
  ``mesh["dp_shard"]``; hasten: ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` with the same
  plan.

Each step is ``zero_grad()``, forward, cross-entropy, backward, ``step()`` (AdamW). A data rank's
batch is seeded by its data-parallel rank (the TP ranks of one data group see the same batch).

Parts:

- ``memory`` (one launch per layout and variant, so no variant's memory mixes with another's):
  live tensor bytes (``hasten.training.memory.live_tensor_bytes()``) and RSS above the process's start,
  after ``prepare`` (or the hand-written sharding) and after ``--steps`` steps; the largest rank's.
- ``time`` (one launch per layout, three models on the same weights: ``hand``, ``hand_again``, the
  A/A control, and ``hasten``, interleaved in blocks, _harness.interleave_steps): the step time
  ratio. The same launch checks that hasten's first loss equals the hand loop's (the same model,
  mesh and batches give the same numbers) and, for ``fsdp4`` and ``hsdp``, counts the bytes of the
  collectives over two steps: every ``dist.all_gather_single`` / ``reduce_scatter_single`` /
  ``all_reduce`` FSDP2 makes (they are Python calls on ``torch.distributed``; the counter wraps
  them in this benchmark process only), with the group's ranks. With 2 machines of 2 processes
  (ranks 0-1 and 2-3, as torchrun numbers them), a collective whose group holds ranks of both
  machines crosses the slow link: its bytes (the gathered output, the scattered input, the reduced
  tensor) are counted as crossing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_memory  # noqa: E402  (the model and the RSS readers)
from _harness import child_env, emit, interleave_steps, ratio_summary, single_thread, summary  # noqa: E402

LAYOUTS = ("fsdp4", "hsdp", "tp_fsdp")
MESHES = {  # layout -> (mesh shape, dim names), the hand-written loop's mesh
    "fsdp4": ((4,), ("dp_shard",)),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard")),
    "tp_fsdp": ((2, 2), ("dp_shard", "tp")),
}
TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
PROCESSES, MACHINE = 4, 2  # 4 processes as 2 machines of 2: ranks 0-1 and 2-3


def hand_shard(model: nn.Module, layout: str):
    """The hand-written reference on its own mesh; returns (model, data rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if layout == "tp_fsdp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp_shard"]
    else:
        dp_mesh = mesh
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if layout == "tp_fsdp":
        return model, mesh.get_local_rank("dp_shard")
    if layout == "hsdp":
        return model, mesh.get_local_rank("dp_replicate") * shape[1] + mesh.get_local_rank("dp_shard")
    return model, mesh.get_local_rank("dp_shard")


def hasten_accelerator(layout: str):
    from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    sizes = {
        "fsdp4": dict(dp_shard_size=4),
        "hsdp": dict(dp_replicate_size=2, dp_shard_size=2),
        "tp_fsdp": dict(dp_shard_size=2, tp_size=2, tp_plan=TP_PLAN),
    }[layout]
    return Accelerator(
        parallelism_config=ParallelismConfig(**sizes),
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
    )


def hasten_data_rank(acc) -> int:
    """This process's rank over the data dims (``dp``, dp_replicate × dp_shard flattened)."""
    return acc.parallelism_config.flattened["dp"].get_local_rank()


def batch(data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(data_rank)
    return torch.randn(fsdp_memory.BATCH, fsdp_memory.WIDTH, generator=g), torch.randint(
        0, 10, (fsdp_memory.BATCH,), generator=g
    )


# ---------------------------------------------------------------------- counting collectives

_COUNTED = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


class CollectiveBytes:
    """Wraps torch.distributed's Python collectives FSDP2 calls (this process only); sums the
    bytes of those whose group spans both machines, and of all."""

    def __init__(self) -> None:
        self.crossing = 0
        self.total = 0
        self.calls: dict[str, int] = {}
        self._saved = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def __enter__(self) -> CollectiveBytes:
        for name, fn in self._saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            if name.startswith("all_gather"):
                tensor = kwargs.get("output_tensor", args[0] if args else None)
            elif name.startswith("reduce_scatter"):
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            else:
                tensor = kwargs.get("tensor", args[0] if args else None)
            size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            self.total += size
            if len({r // MACHINE for r in ranks}) > 1:
                self.crossing += size
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


# ---------------------------------------------------------------------- one process of a launch


def step_fn(model, opt, backward, x, y):
    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        return loss.detach()

    return step


def memory_worker(args: argparse.Namespace) -> None:
    from hasten.training.memory import live_tensor_bytes

    def live() -> int:
        gc.collect()
        return live_tensor_bytes()

    if args.variant == "hand":
        dist.init_process_group("gloo")
    else:
        acc = hasten_accelerator(args.layout)
    rank = dist.get_rank()
    gc.collect()
    start_rss, start_live = fsdp_memory.rss_bytes(), live()
    model = fsdp_memory.make()
    if args.variant == "hand":
        model, data_rank = hand_shard(model, args.layout)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        backward = torch.Tensor.backward
    else:
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        data_rank = hasten_data_rank(acc)
        backward = acc.backward
    dist.barrier()
    at = {"prepare": {"live": live() - start_live, "rss": fsdp_memory.rss_bytes() - start_rss}}
    step = step_fn(model, opt, backward, *batch(data_rank))
    for _ in range(args.steps):
        step()
    dist.barrier()
    at["steps"] = {"live": live() - start_live, "rss": fsdp_memory.rss_bytes() - start_rss}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": rank, "data_rank": data_rank, "at": at})
    if rank == 0:
        emit({"ranks": ranks}, args.out)
    dist.barrier()


def time_worker(args: argparse.Namespace) -> None:
    acc = hasten_accelerator(args.layout)
    rank = dist.get_rank()
    steps, first_loss, data_ranks = {}, {}, {}
    for name in ("hand", "hand_again"):
        model, data_ranks[name] = hand_shard(fsdp_memory.make(), args.layout)
        steps[name] = step_fn(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.Tensor.backward, *batch(data_ranks[name])
        )
    model = fsdp_memory.make()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    data_ranks["hasten"] = hasten_data_rank(acc)
    steps["hasten"] = step_fn(model, opt, acc.backward, *batch(data_ranks["hasten"]))
    for name, step in steps.items():
        first_loss[name] = float(step())
    counted = {}
    if args.layout in ("fsdp4", "hsdp"):
        for name in ("hand", "hasten"):
            with CollectiveBytes() as c:
                for _ in range(args.count_steps):
                    steps[name]()
            counted[name] = {
                "crossing": c.crossing / args.count_steps,
                "total": c.total / args.count_steps,
                "calls": c.calls,
            }

    def loop(step):
        def epoch():
            for _ in range(1000):
                step()
                yield None

        return epoch

    times = interleave_steps(
        {name: loop(step) for name, step in steps.items()}, rounds=args.rounds, steps=args.block_steps, warmup=1
    )
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"first_loss": first_loss, "data_ranks": data_ranks, "counted": counted})
    if rank == 0:
        emit(
            {
                "layout": args.layout,
                "rounds": args.rounds,
                "steps_per_block": args.block_steps,
                "hand_step_s": summary(times["hand"])["median"],
                "step_vs_hand": ratio_summary(times, "hand", "hasten"),
                "hand_again": ratio_summary(times, "hand", "hand_again"),
                "ranks": ranks,
            },
            args.out,
        )
    dist.barrier()


# ---------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(PROCESSES),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            os.path.abspath(__file__),
            "--width",
            str(args.width),
            "--blocks",
            str(args.blocks),
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--block-steps",
            str(args.block_steps),
            "--count-steps",
            str(args.count_steps),
            "--out",
            out,
            *extra,
        ]
        env = {**child_env(), **fsdp_memory.MALLOC_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"{' '.join(extra)} failed with exit status {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        with open(out, encoding="utf-8") as fp:
            return json.load(fp)


def driver(args: argparse.Namespace) -> None:
    fsdp_memory.WIDTH, fsdp_memory.BLOCKS = args.width, args.blocks
    result: dict = {"params": fsdp_memory.params_at(args.width), "processes": PROCESSES, "layouts": {}}
    started = time.perf_counter()
    for layout in LAYOUTS:
        mem = {v: launch(args, "--part", "memory", "--layout", layout, "--variant", v) for v in ("hand", "hasten")}
        timed = launch(args, "--part", "time", "--layout", layout)
        worst = {
            v: {
                f"{w}_{when}": max(r["at"][when][w] for r in mem[v]["ranks"])
                for w in ("live", "rss")
                for when in ("prepare", "steps")
            }
            for v in mem
        }
        losses = [r["first_loss"] for r in timed["ranks"]]
        cell = {
            "hand": worst["hand"],
            "hasten": worst["hasten"],
            "memory_vs_hand": {k: worst["hasten"][k] / worst["hand"][k] for k in worst["hand"]},
            "step_vs_hand": timed["step_vs_hand"],
            "hand_again": timed["hand_again"],
            "hand_step_s": timed["hand_step_s"],
            "same_first_loss": all(
                abs(loss["hasten"] - loss["hand"]) <= 1e-5 * max(1.0, abs(loss["hand"])) for loss in losses
            ),
            "data_ranks": {v: [r["data_ranks"][v] for r in timed["ranks"]] for v in ("hand", "hasten")},
            "hasten_data_ranks_memory": [r["data_rank"] for r in mem["hasten"]["ranks"]],
        }
        if timed["ranks"][0]["counted"]:
            cell["bytes_per_step"] = {
                v: {k: max(r["counted"][v][k] for r in timed["ranks"]) for k in ("crossing", "total")}
                for v in ("hand", "hasten")
            }
        result["layouts"][layout] = cell
        print(f"{layout}: {json.dumps(cell)}", file=sys.stderr, flush=True)
    crossing = {
        layout: result["layouts"][layout].get("bytes_per_step", {}).get("hasten", {}).get("crossing")
        for layout in ("fsdp4", "hsdp")
    }
    if crossing["fsdp4"]:
        result["crossing_hsdp_vs_fsdp4"] = crossing["hsdp"] / crossing["fsdp4"]
    result["seconds"] = time.perf_counter() - started
    emit(result, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("memory", "time"), help="one process of a launch (default: the driver)")
    parser.add_argument("--layout", choices=LAYOUTS)
    parser.add_argument("--variant", choices=("hand", "hasten"))
    parser.add_argument("--width", type=int, default=1024, help="1024 with 4 blocks: ~34M parameters")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps before the memory is read")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block-steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--count-steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true", help="accepted for bench/run.py; nothing else is compared")
    args = parser.parse_args()
    single_thread()
    if args.part is None:
        driver(args)
        return
    fsdp_memory.WIDTH, fsdp_memory.BLOCKS = args.width, args.blocks
    (memory_worker if args.part == "memory" else time_worker)(args)


if __name__ == "__main__":
    main()
