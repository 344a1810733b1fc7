"""Row 8: memory per process with FSDP2, hasten ÷ the hand-written ``fully_shard`` loop and ÷ DDP,
at 2 and 4 gloo processes, for a ~50M- and a ~200M-parameter model with AdamW.

Run as ``python fsdp_memory.py`` (the driver): every cell (variant, width, processes) is a
launch of its own, ``python -m torch.distributed.run --nproc_per_node N fsdp_memory.py
--variant V``, so no variant's memory mixes with another's. The launches run with glibc told
to hand freed memory back (``MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0
MALLOC_MMAP_THRESHOLD_=65536``), so RSS falls when tensors are freed instead of staying at the
high-water mark of the heap.

The variants, each building the same model on the CPU on every rank with the same seed:

- ``hand``: torch by hand, the reference: ``init_process_group("gloo")``, a 1-D CPU
  ``DeviceMesh``, ``fully_shard`` on each ``Block``, then on the root, AdamW built on the
  sharded parameters;
- ``hasten``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  transformer_cls_names_to_wrap=["Block"]))`` and ``prepare(model, AdamW(model.parameters()))``,
  the optimizer built before ``prepare`` as Accelerate's scripts do;
- ``ddp``: ``Accelerator()`` (hasten's DDP) and the same ``prepare``.

Each process measures, after its imports and its process group (the baseline), after
``prepare`` (or the hand-written sharding and optimizer) and after ``--steps`` AdamW steps
(``zero_grad()`` first in each step, so the last step's gradients are still there):

- live tensor bytes: ``hasten.training.memory.live_tensor_bytes()``, every tensor the garbage collector
  can reach, gradients and DTensor shards included, each storage once (blind to what C++ holds
  alone, such as DDP's gradient buckets);
- RSS (``VmRSS``) above the baseline, and the peak RSS (``ru_maxrss``) above it.

The driver keeps, per cell, the largest figure over the ranks (the process that must fit), and
works out hasten ÷ hand, hasten ÷ DDP and the 1/N line (4 processes ÷ 2). A cell whose estimated
total memory (``--budget-gb``) does not fit this shared machine is left out, with the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import child_env, emit, single_thread, summary  # noqa: E402

WIDTH, BLOCKS, BATCH = 1024, 6, 8  # 6 x (2 x 4 x 1024 x 1024) ~ 50M parameters; width 2048 ~ 200M
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
VARIANTS = ("hasten", "hand", "ddp")
# Estimated bytes per parameter per process, for the budget: fp32 parameters, gradients and
# AdamW's two moments, plus DDP's gradient buckets; FSDP2 holds 1/N of all that, plus the full
# model every rank builds before sharding it (and, today, hasten's kept original parameters).
BYTES_PER_PARAM = {"ddp": 20.0, "fsdp_fixed": 6.0, "fsdp_per_rank": 16.0}


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
    """The model at the module's WIDTH, the same weights on every rank (seed 0)."""
    torch.manual_seed(0)
    return Net()


def params_at(width: int) -> int:
    """Parameters of the model at ``width`` (what make() builds), without building it."""
    block = 2 * width + (4 * width * width + 4 * width) + (4 * width * width + width)
    return BLOCKS * block + width * 10 + 10


def hand_shard(model: nn.Module, mesh) -> nn.Module:
    """The hand-written reference: fully_shard each Block, then the root (torch's defaults)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ---------------------------------------------------------------------- one process of a launch


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fp:
        return int(fp.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args: argparse.Namespace) -> None:
    """One process of a launch: build, shard or wrap, step, and measure as it goes."""
    global WIDTH
    WIDTH = args.width
    single_thread()
    import torch.distributed as dist

    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.training.memory import live_tensor_bytes

    def live() -> int:
        gc.collect()
        return live_tensor_bytes()

    if args.variant == "hand":
        dist.init_process_group("gloo")
    elif args.variant == "hasten":
        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    else:
        acc = Accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    start_rss, start_live = rss_bytes(), live()
    t0 = time.perf_counter()
    model = make()
    if args.variant == "hand":
        from torch.distributed.device_mesh import init_device_mesh

        model = hand_shard(model, init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        backward = torch.Tensor.backward
    else:
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        backward = acc.backward
    dist.barrier()
    prepare_s = time.perf_counter() - t0
    at = {"prepare": {"live": live() - start_live, "rss": rss_bytes() - start_rss}}
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(rank))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        del loss
    dist.barrier()
    steps_s = time.perf_counter() - t0
    at["steps"] = {"live": live() - start_live, "rss": rss_bytes() - start_rss}
    mine = {
        "rank": rank,
        "at": at,
        "peak_rss": peak_rss_bytes() - start_rss,
        "start_rss": start_rss,
        "prepare_s": prepare_s,
        "steps_s": steps_s,
        "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
    }
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        emit({"variant": args.variant, "width": WIDTH, "processes": world, "ranks": ranks}, args.out)
    dist.barrier()


# ---------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(variant: str, width: int, procs: int, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(procs),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            os.path.abspath(__file__),
            "--variant",
            variant,
            "--width",
            str(width),
            "--steps",
            str(steps),
            "--out",
            out,
        ]
        env = {**child_env(), **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):  # say why: the run's own error
            raise RuntimeError(
                f"{variant} at width {width}, {procs} processes, failed with exit status "
                f"{proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        with open(out, encoding="utf-8") as fp:
            return json.load(fp)


def estimate_gb(variant: str, params: int, procs: int) -> float:
    """Estimated memory of a whole launch (all its processes), in GB."""
    if variant == "ddp":
        per = BYTES_PER_PARAM["ddp"] * params
    else:
        per = BYTES_PER_PARAM["fsdp_fixed"] * params + BYTES_PER_PARAM["fsdp_per_rank"] * params / procs
    return procs * (per + 0.4e9) / 1e9  # + ~0.4 GB of torch per process


def cell(runs: list[dict]) -> dict:
    """Per-process figures of one cell: the largest rank's, median over the launches."""

    def worst(get) -> float:
        return summary([max(get(r) for r in run["ranks"]) for run in runs])["median"]

    out = {
        f"{what}_{when}": worst(lambda r, w=what, n=when: r["at"][n][w])
        for what in ("live", "rss")
        for when in ("prepare", "steps")
    }
    out["peak_rss"] = worst(lambda r: r["peak_rss"])
    out["prepare_s"] = worst(lambda r: r["prepare_s"])
    out["steps_s"] = worst(lambda r: r["steps_s"])
    out["per_rank"] = {k: [r["at"][w][k] for r in runs[0]["ranks"]] for k in ("live", "rss") for w in ("steps",)}
    return out


MEASURES = ("live_prepare", "live_steps", "rss_prepare", "rss_steps")


def driver(args: argparse.Namespace) -> None:
    widths = [int(w) for w in args.widths.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    cells: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    order = [(w, n, v) for w in widths for n in procs for v in VARIANTS]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for w, n, v in order if r % 2 == 0 else order[::-1]:
            key = f"{v}/{w}/{n}"
            need = estimate_gb(v, params_at(w), n)
            if need > args.budget_gb:
                skipped[key] = (
                    f"{v} at {params_at(w) / 1e6:.0f}M parameters and {n} processes needs ~{need:.0f} GB "
                    f"(estimated), over the {args.budget_gb:g} GB this row allows itself on a shared machine"
                )
                continue
            runs.setdefault(key, []).append(launch(v, w, n, args.steps, args.timeout))
    malloc = {k: v for run in runs.values() for rank in run[0]["ranks"] for k, v in rank["malloc_env"].items()}
    for key, rs in runs.items():
        cells[key] = cell(rs)
    grid = []
    for w in widths:
        for n in procs:
            h, hand, ddp = (cells.get(f"{v}/{w}/{n}") for v in VARIANTS)
            if h is None or hand is None:
                continue
            entry = {
                "width": w,
                "params": params_at(w),
                "processes": n,
                "hasten": h,
                "hand": hand,
                "ddp": ddp,
                "vs_hand": {m: h[m] / hand[m] for m in MEASURES},
                "vs_ddp": None if ddp is None else {m: h[m] / ddp[m] for m in MEASURES},
                "ddp_skipped": skipped.get(f"ddp/{w}/{n}"),
            }
            grid.append(entry)
    scaling = []
    if len(procs) >= 2:
        lo, hi = min(procs), max(procs)
        for w in widths:
            a, b = cells.get(f"hasten/{w}/{lo}"), cells.get(f"hasten/{w}/{hi}")
            c, d = cells.get(f"hand/{w}/{lo}"), cells.get(f"hand/{w}/{hi}")
            if a and b and c and d:
                scaling.append(
                    {
                        "width": w,
                        "params": params_at(w),
                        "from": lo,
                        "to": hi,
                        "hasten": {m: b[m] / a[m] for m in ("live_steps", "rss_steps")},
                        "hand": {m: d[m] / c[m] for m in ("live_steps", "rss_steps")},
                    }
                )
    emit(
        {
            "steps": args.steps,
            "rounds": args.rounds,
            "malloc_env": malloc,
            "grid": grid,
            "scaling": scaling,
            "skipped": skipped,
        },
        args.out,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, help="(under torch.distributed.run) one process of a launch")
    parser.add_argument("--width", type=int, default=1024, help="with --variant: the model's width")
    parser.add_argument(
        "--widths", default="1024,2048", help="the driver's widths (1024 ~ 50M, 2048 ~ 200M parameters)"
    )
    parser.add_argument("--procs", default="2,4", help="the driver's process counts")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="launches per cell (the median is kept)")
    parser.add_argument("--budget-gb", type=float, default=12.0, help="leave out cells estimated to need more")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    args = parser.parse_args()
    if args.variant:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
