"""Row 3: 2-process gloo training throughput (samples/s), a prepared loop ÷ a raw
``DistributedDataParallel`` loop. Run under ``python -m torch.distributed.run --nproc_per_node 2``.

The raw loop is the hand-written one: ``init_process_group("gloo")``, a ``DistributedSampler``
and ``DistributedDataParallel`` with its defaults; a second raw loop passes ``bucket_cap_mb=25``
as hasten does (which also drops DDP's small first bucket), to tell hasten's own cost from
that choice. hasten's, Accelerate's and Fabric's loops each wrap their own
copy of the same model and share that process group (each finds it already initialised).
All loops run interleaved in blocks of a few steps (the same order on both ranks); a step's time
is wall time, since waiting for the gradient all-reduce is part of it. Rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import emit, interleave_steps, ratio_summary, single_thread
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH = 32  # per process
IN, HIDDEN, OUT = 128, 512, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def make_dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(samples, IN, generator=g), torch.randint(0, OUT, (samples,), generator=g))


DDP_FACTS: dict[str, dict] = {}  # how each loop's DDP buckets its gradients


def ddp_facts(name: str, model: torch.nn.Module) -> None:
    ddp = next(
        m
        for m in [model, getattr(model, "module", None), getattr(model, "_forward_module", None)]
        if isinstance(m, torch.nn.parallel.DistributedDataParallel)
    )
    DDP_FACTS[name] = {
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "small_first_bucket": bool(ddp.bucket_bytes_cap_default),
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
    }


def train_steps(loader, model, opt, backward) -> Iterator[None]:
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        yield


def raw_loop(samples: int, name: str = "raw", bucket_cap_mb: float | None = None):
    model = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=bucket_cap_mb)
    ddp_facts(name, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = make_dataset(samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    epoch = [0]

    def run() -> Iterator[None]:
        sampler.set_epoch(epoch[0])
        epoch[0] += 1
        return train_steps(loader, model, opt, torch.Tensor.backward)

    return run


def hasten_loop(samples: int):
    from hasten import Accelerator

    acc = Accelerator(cpu=True)
    model = make_model()
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        DataLoader(make_dataset(samples), batch_size=BATCH, shuffle=True),
    )
    ddp_facts("hasten", model)
    return lambda: train_steps(loader, model, opt, acc.backward)


def accelerate_loop(samples: int):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = make_model()
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        DataLoader(make_dataset(samples), batch_size=BATCH, shuffle=True),
    )
    ddp_facts("accelerate", model)
    return lambda: train_steps(loader, model, opt, acc.backward)


def fabric_loop(samples: int):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    fabric.launch()  # under torch.distributed.run this only joins the existing process group
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(make_dataset(samples), batch_size=BATCH, shuffle=True))
    ddp_facts("fabric", model)
    return lambda: train_steps(loader, model, opt, fabric.backward)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=8, help="steps of each loop per round")
    parser.add_argument("--samples", type=int, default=4096, help="samples per epoch, all ranks together")
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Fabric out")
    parser.add_argument("--out")
    args = parser.parse_args()
    single_thread()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")  # the raw loop's own set-up; the libraries find it initialised
    world = dist.get_world_size()

    loops = {
        "raw": raw_loop(args.samples),
        "raw_again": raw_loop(args.samples, "raw_again"),
        # hasten passes bucket_cap_mb=25, which also turns off DDP's small (1 MiB) first bucket:
        # a raw loop built the same way tells the library's cost from that choice.
        "raw_cap25": raw_loop(args.samples, "raw_cap25", bucket_cap_mb=25),
        "hasten": hasten_loop(args.samples),
    }
    if not args.no_others and importlib.util.find_spec("accelerate") is not None:
        loops["accelerate"] = accelerate_loop(args.samples)
    if not args.no_others and importlib.util.find_spec("lightning") is not None:
        loops["fabric"] = fabric_loop(args.samples)
    times = interleave_steps(loops, args.rounds, args.steps)

    # Throughput ratio = raw step time / library step time (same samples per step).
    mine = {name: [t for t in times[name]] for name in loops}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        result = {"row": "ddp_throughput", "world_size": world, "batch_per_process": BATCH}
        raw_step = sorted(times["raw"])[len(times["raw"]) // 2]
        result["raw_samples_per_s"] = world * BATCH / raw_step
        result["ddp"] = DDP_FACTS
        for name in loops:
            if name == "raw":
                continue
            # per rank, per round: raw time / this loop's time (throughput ratio); pooled over ranks
            per_rank = [ratio_summary(r, name, "raw") for r in gathered]
            result[name] = ratio_summary(
                {"a": [t for r in gathered for t in r[name]], "b": [t for r in gathered for t in r["raw"]]}, "a", "b"
            )
            result[name]["per_rank_median"] = [p["median"] for p in per_rank]
        result["hasten_vs_raw_cap25"] = ratio_summary(
            {"a": [t for r in gathered for t in r["hasten"]], "b": [t for r in gathered for t in r["raw_cap25"]]},
            "a",
            "b",
        )
        emit(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
