"""Row 15: pipeline parallelism on 4 gloo processes (4 stages, one per process), hasten ÷ the
hand-written ``torch.distributed.pipelining`` loop, for the schedules 1F1B and GPipe at 4, 8 and
16 microbatches: the step time, the measured bubble beside the theory, and memory per process ÷
the whole model's.

Run as ``python pipeline_step.py --out result.json`` (the driver; ``--quick`` for a smoke run).
Every launch is ``python -m torch.distributed.run --nproc_per_node 4 pipeline_step.py --part P``:

- ``time`` (one launch per schedule and microbatch count): three pipelines on the same weights,
  ``hand``, ``hand_again`` (an identical second hand-written loop, the A/A control) and
  ``hasten``, interleaved in blocks of a few steps (_harness.interleave_steps; every rank runs the
  same seeded order, so the schedules' messages pair up). A step is the pipeline's forward and
  backward over all microbatches, ``optimizer.step()`` and ``zero_grad()``. Before timing, each
  pipeline runs one step on the same batch: hasten's mean loss and its stage's parameters after
  the step must equal the hand loop's. Then each rank times its stage's forward + backward on one
  microbatch alone (the ranks one after another, the others waiting in a barrier; no
  communication, the same shapes) for the bubble: idle = 1 - m × (that time) ÷ (the rank's
  median time inside the pipeline call, ``schedule.step`` / ``pipeline_step``), beside the
  theory (p - 1) ÷ (m + p - 1).
- ``memory`` (one launch per variant, 1F1B): parameter + gradient + AdamW state bytes of the
  stage (tensors counted) and the peak RSS (``ru_maxrss``) of each process after ``--mem-steps``
  steps, run with glibc told to hand freed memory back (fsdp_memory.MALLOC_ENV); beside it
  ``--part whole``, one process training the whole model on the whole batch.

The model: an ``nn.Embedding``, ``--blocks`` residual MLP blocks (LayerNorm, Linear d -> 4d,
GELU, Linear 4d -> d) in ``self.layers = nn.ModuleList``, a final LayerNorm and a head; its
forward skips the parts that are None. The hand-written stage is built torchtitan's way: a
deepcopy of the model with the blocks and parts this rank does not own deleted (an even split of
``layers``), ``PipelineStage(stage, rank, 4, cpu, group=WORLD)``, ``Schedule1F1B`` /
``ScheduleGPipe(stage, m, loss_fn=...)``, ``step(x)`` on the first rank, ``step(target=y,
losses=losses)`` on the last, ``step()`` between, then AdamW's ``step()`` / ``zero_grad()``.
hasten's: ``ParallelismConfig(pp_size=4, pp_handler=TorchPipelineParallelConfig(schedule,
microbatches))``, ``prepare(model, AdamW)``, ``accelerator.pipeline_step(model, x, y, loss_fn)``
(all in :func:`hasten_pipeline`). If hasten's side fails, the driver keeps its error verbatim and
runs the launch again without it, so the hand-written figures still come out.

With 4 processes on a machine of 2 cores, the stages share the cores: the measured idle fraction
then includes the waits for a core (at least 1 - cores ÷ processes when all stages are busy).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import child_env, emit, interleave_steps, ratio_summary, single_thread, summary  # noqa: E402
from fsdp_memory import MALLOC_ENV, peak_rss_bytes, rss_bytes  # noqa: E402

PROCESSES = 4  # pp_size: one stage per process
SCHEDULES = ("1F1B", "GPipe")
N_BATCHES = 4  # batches per epoch, the same on every rank
LR = 1e-4
ROW = "15"


# ---------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int, d: int, blocks: int) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm: nn.Module | None = nn.LayerNorm(d)
        self.head: nn.Module | None = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def make_model(args: argparse.Namespace) -> Net:
    torch.manual_seed(0)
    return Net(args.vocab, args.width, args.blocks)


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq)
    return [
        (torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g))
        for _ in range(N_BATCHES)
    ]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def owned_blocks(stage: int, stages: int, blocks: int) -> range:
    """An even split of ``layers``: stage s owns blocks [s·n/p, (s+1)·n/p)."""
    return range(stage * blocks // stages, (stage + 1) * blocks // stages)


def whole_name(name: str, first_block: int) -> str:
    """A hand stage's parameter name under the whole model's names (its ``layers`` renumbered from 0)."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = str(int(parts[1]) + first_block)
    return ".".join(parts)


# ---------------------------------------------------------------------- the two pipelines
@dataclass
class Pipeline:
    """One rank's side of a pipeline: ``run(x, y)`` is the forward + backward over all microbatches
    (the batch's mean loss, or None where this rank does not know it); ``step()`` one training step."""

    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    optimizer: Any
    module: nn.Module  # this rank's stage
    names: dict[str, str]  # stage parameter name -> the whole model's name
    inside: list[float] = field(default_factory=list)  # seconds spent in ``run`` per step

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        start = time.perf_counter()
        loss = self.run(x, y)
        self.inside.append(time.perf_counter() - start)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss


def hand_stage(model: Net, stage: int, stages: int) -> tuple[Net, range]:
    """torchtitan's way: a deepcopy of the whole model without what this stage does not own."""
    module = copy.deepcopy(model)
    owned = owned_blocks(stage, stages, len(model.layers))
    module.layers = nn.ModuleList(module.layers[i] for i in owned)
    if stage != 0:
        module.embed = None
    if stage != stages - 1:
        module.norm = None
        module.head = None
    return module, owned


def hand_pipeline(model: Net, schedule: str, microbatches: int) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    module, owned = hand_stage(model, rank, stages)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"), group=dist.group.WORLD)
    cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        if rank == 0:
            sched.step(x)
            return None
        if rank == stages - 1:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            return torch.stack(losses).mean().detach()
        sched.step()
        return None

    names = {n: whole_name(n, owned.start) for n, _ in module.named_parameters()}
    return Pipeline(run, optimizer, module, names)


def hasten_pipeline(model: Net, schedule: str, microbatches: int, timeout_s: float) -> Pipeline:
    """hasten's side, all of it: the Accelerator, ``prepare`` and ``pipeline_step``."""
    from datetime import timedelta

    from hasten import Accelerator, InitProcessGroupKwargs, ParallelismConfig
    from hasten.utils import TorchPipelineParallelConfig

    pc = ParallelismConfig(
        pp_size=PROCESSES, pp_handler=TorchPipelineParallelConfig(schedule=schedule, microbatches=microbatches)
    )
    acc = Accelerator(
        parallelism_config=pc, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))]
    )
    prepared, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    module = acc.unwrap_model(prepared)

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return acc.pipeline_step(prepared, x, y, loss_fn).detach()

    return Pipeline(run, optimizer, module, {n: n for n, _ in module.named_parameters()})


# ---------------------------------------------------------------------- measurements in a launch
def state_bytes(module: nn.Module, optimizer: Any) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes (each tensor counted once)."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    params = list(module.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)
    opt = sum(nbytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    counted = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": opt,
        "numel": sum(p.numel() for p in params),
    }
    counted["total"] = counted["params"] + counted["grads"] + counted["optimizer"]
    return counted


def check_step(pipes: dict[str, Pipeline], batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One step of every pipeline on the same batch from the same weights; hasten's mean loss and its
    stage's parameters after the step, beside the hand loop's (this rank's)."""
    losses = {name: pipe.step(*batch) for name, pipe in pipes.items()}
    last = dist.get_world_size() - 1
    hand_loss = [losses["hand"]]
    dist.broadcast_object_list(hand_loss, src=last)
    out: dict[str, Any] = {"hand_loss": float(hand_loss[0])}
    if "hasten" not in pipes:
        return out
    out["hasten_loss"] = float(losses["hasten"])
    hand = {pipes["hand"].names[n]: p for n, p in pipes["hand"].module.named_parameters()}
    ours = {pipes["hasten"].names[n]: p for n, p in pipes["hasten"].module.named_parameters()}
    out["same_names"] = sorted(hand) == sorted(ours)
    if not out["same_names"]:
        out["names"] = {"hand": sorted(hand)[:6], "hasten": sorted(ours)[:6]}
    shared = set(hand) & set(ours)
    with torch.no_grad():
        out["max_param_diff"] = max((float((hand[n] - ours[n]).abs().max()) for n in shared), default=None)
    return out


def alone_seconds(module: nn.Module, args: argparse.Namespace, microbatches: int, reps: int) -> float:
    """This stage's forward + backward on one microbatch, with no communication (median of ``reps``)."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    g = torch.Generator().manual_seed(2)
    mb = args.batch // microbatches
    if rank == 0:
        x = torch.randint(0, args.vocab, (mb, args.seq), generator=g)
    else:
        x = torch.randn(mb, args.seq, args.width, generator=g).requires_grad_()
    y = torch.randint(0, args.vocab, (mb, args.seq), generator=g)
    taken = []
    for i in range(reps + 2):
        start = time.perf_counter()
        out = module(x)
        if rank == last:
            loss_fn(out, y).backward()
        else:
            out.backward(torch.ones_like(out))
        if i >= 2:  # two warm-up runs
            taken.append(time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    return statistics.median(taken)


def measure_alone(module: nn.Module, args: argparse.Namespace, microbatches: int) -> float:
    """``alone_seconds`` on each rank in turn, the others waiting in a barrier."""
    mine = 0.0
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            mine = alone_seconds(module, args, microbatches, args.alone_reps)
        dist.barrier()
    return mine


def init_gloo(args: argparse.Namespace) -> None:
    """The hand-written side's process group (hasten's Accelerator makes its own)."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))


def time_worker(args: argparse.Namespace) -> None:
    model = make_model(args)
    pipes: dict[str, Pipeline] = {}
    if args.hasten:
        try:
            pipes["hasten"] = hasten_pipeline(make_model(args), args.schedule, args.microbatches, args.pg_timeout)
        except Exception:
            write_error(args)
            raise
    if not dist.is_initialized():
        init_gloo(args)
    for name in ("hand", "hand_again"):
        pipes[name] = hand_pipeline(model, args.schedule, args.microbatches)
    batches = make_batches(args)
    try:
        checked = check_step(pipes, batches[0])
    except Exception:
        write_error(args)
        raise
    for pipe in pipes.values():
        pipe.inside.clear()

    def loop(pipe: Pipeline) -> Callable[[], Iterator[None]]:
        def epoch() -> Iterator[None]:
            for batch in batches:
                pipe.step(*batch)
                yield None

        return epoch

    wall, cpu = time.perf_counter(), time.process_time()
    times = interleave_steps({n: loop(p) for n, p in pipes.items()}, args.rounds, args.steps, warmup=1)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    alone = measure_alone(pipes["hand"].module, args, args.microbatches)
    mine = {
        "rank": dist.get_rank(),
        "check": checked,
        "alone_s": alone,
        "cpu_share": cpu / wall,  # this process's CPU time (all its threads) over the timed steps ÷ their wall time
        "inside_s": {n: statistics.median(p.inside) for n, p in pipes.items()},
        "step_s": {n: summary(t)["median"] for n, t in times.items()},
    }
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        result = {"hand_again": ratio_summary(times, "hand", "hand_again"), "ranks": ranks}
        if "hasten" in pipes:
            result["step_vs_hand"] = ratio_summary(times, "hand", "hasten")
        emit(result, args.out)
    dist.barrier()


def memory_worker(args: argparse.Namespace) -> None:
    gc.collect()
    start_rss = rss_bytes()
    model = make_model(args)
    if args.variant == "hasten":
        try:
            pipe = hasten_pipeline(model, args.schedule, args.microbatches, args.pg_timeout)
        except Exception:
            write_error(args)
            raise
    else:
        init_gloo(args)
        pipe = hand_pipeline(model, args.schedule, args.microbatches)
    del model
    gc.collect()
    batches = make_batches(args)
    for i in range(args.mem_steps):
        pipe.run(*batches[i % N_BATCHES])
        pipe.optimizer.step()  # no zero_grad after the last: its gradients are counted
        if i < args.mem_steps - 1:
            pipe.optimizer.zero_grad()
    mine = {
        "rank": dist.get_rank(),
        "bytes": state_bytes(pipe.module, pipe.optimizer),
        "start_rss": start_rss,
        "peak_rss": peak_rss_bytes(),
    }
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        emit({"variant": args.variant, "ranks": ranks}, args.out)
    dist.barrier()


def whole_worker(args: argparse.Namespace) -> None:
    """One process training the whole model on the whole batch (the baseline for memory)."""
    gc.collect()
    start_rss = rss_bytes()
    model = make_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = make_batches(args)
    for i in range(args.mem_steps):
        optimizer.zero_grad()
        x, y = batches[i % N_BATCHES]
        loss_fn(model(x), y).backward()
        optimizer.step()
    emit({"bytes": state_bytes(model, optimizer), "start_rss": start_rss, "peak_rss": peak_rss_bytes()}, args.out)


def write_error(args: argparse.Namespace) -> None:
    """This rank's traceback, verbatim, beside the result file (the driver reports it)."""
    if args.out:
        with open(f"{args.out}.rank{os.environ.get('RANK', '?')}.err", "w", encoding="utf-8") as fp:
            fp.write(traceback.format_exc())


# ---------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchFailed(RuntimeError):
    def __init__(self, message: str, errors: dict[str, str]) -> None:
        super().__init__(message)
        self.errors = errors


def shape_args(args: argparse.Namespace) -> list[str]:
    keys = ("vocab", "width", "blocks", "batch", "seq", "rounds", "steps", "alone_reps", "mem_steps", "pg_timeout")
    return [a for k in keys for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def launch(args: argparse.Namespace, part: str, *extra: str, processes: int = PROCESSES) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        script = [os.path.abspath(__file__), "--part", part, *shape_args(args), "--out", out, *extra]
        if processes > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
            cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), *script]
        else:
            cmd = [sys.executable, *script]
        env = {**child_env(), **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        errors = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".err"):
                with open(os.path.join(tmp, name), encoding="utf-8") as fp:
                    errors[name.rsplit(".", 2)[-2]] = fp.read()
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise LaunchFailed(f"{part} {' '.join(extra)} failed with exit status {proc.returncode}:\n{tail}", errors)
        with open(out, encoding="utf-8") as fp:
            return json.load(fp)


def time_cell(args: argparse.Namespace, schedule: str, m: int, hasten_error: dict) -> dict:
    """One launch for (schedule, m); if hasten's side fails, its error is kept and the launch is
    run again with the hand-written loops only."""
    extra = ("--schedule", schedule, "--microbatches", str(m))
    if args.hasten:
        try:
            return cell_result(launch(args, "time", *extra), m)
        except (LaunchFailed, subprocess.TimeoutExpired) as exc:
            errors = getattr(exc, "errors", {})
            first = next(iter(errors.values()), None) if errors else None
            hasten_error[f"{schedule} m={m}"] = first or str(exc)
            print(f"{schedule} m={m}: hasten's side failed:\n{first or exc}", file=sys.stderr, flush=True)
    return cell_result(launch(args, "time", *extra, "--no-hasten"), m)


def cell_result(timed: dict, m: int) -> dict:
    ranks = timed["ranks"]
    p = len(ranks)
    cell: dict[str, Any] = {
        "hand_again": timed["hand_again"],
        "step_vs_hand": timed.get("step_vs_hand"),
        "hand_step_s": ranks[0]["step_s"]["hand"],
        "theory_bubble": (p - 1) / (m + p - 1),
        "alone_s": [r["alone_s"] for r in ranks],
        "inside_s": {n: [r["inside_s"][n] for r in ranks] for n in ranks[0]["inside_s"]},
        "check": [r["check"] for r in ranks],
        "cpu_share": [r["cpu_share"] for r in ranks],
    }
    cell["idle"] = {
        n: [1 - m * r["alone_s"] / r["inside_s"][n] for r in ranks] for n in ranks[0]["inside_s"] if n != "hand_again"
    }
    if cell["step_vs_hand"] is not None:
        hand_loss = ranks[-1]["check"]["hand_loss"]
        cell["same_loss"] = all(
            abs(r["check"]["hasten_loss"] - hand_loss) <= 1e-5 * max(1.0, abs(hand_loss)) for r in ranks
        )
        cell["same_params"] = all(
            r["check"]["same_names"]
            and r["check"]["max_param_diff"] is not None
            and r["check"]["max_param_diff"] <= 1e-6
            for r in ranks
        )
    return cell


def memory_cells(args: argparse.Namespace, hasten_error: dict) -> dict:
    """Tensor bytes and peak RSS per process (hand, hasten), and one process with the whole model."""
    extra = ("--schedule", args.mem_schedule, "--microbatches", str(args.mem_microbatches))
    whole = launch(args, "whole", processes=1)
    out: dict[str, Any] = {"whole": whole, "schedule": args.mem_schedule, "microbatches": args.mem_microbatches}
    for variant in ("hand", "hasten") if args.hasten else ("hand",):
        try:
            ranks = launch(args, "memory", *extra, "--variant", variant)["ranks"]
        except (LaunchFailed, subprocess.TimeoutExpired) as exc:
            errors = getattr(exc, "errors", {})
            hasten_error[f"memory {variant}"] = next(iter(errors.values()), None) or str(exc)
            continue
        out[variant] = {
            "ranks": ranks,
            "bytes_vs_whole": [r["bytes"]["total"] / whole["bytes"]["total"] for r in ranks],
            "peak_rss_vs_whole": [r["peak_rss"] / whole["peak_rss"] for r in ranks],
            "peak_above_start_vs_whole": [
                (r["peak_rss"] - r["start_rss"]) / (whole["peak_rss"] - whole["start_rss"]) for r in ranks
            ],
        }
    return out


def driver(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    result: dict[str, Any] = {
        "row": "pipeline_step",
        "processes": PROCESSES,
        "cpus": os.cpu_count(),
        "model": {k: getattr(args, k) for k in ("vocab", "width", "blocks", "batch", "seq")},
        "params": sum(p.numel() for p in make_model(args).parameters()),
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "cells": {},
        "hasten_error": {},
    }
    for schedule in args.schedules:
        for m in args.microbatches_list:
            began = time.perf_counter()
            cell = time_cell(args, schedule, m, result["hasten_error"])
            cell["seconds"] = time.perf_counter() - began
            result["cells"][f"{schedule} m={m}"] = cell
            print(f"{schedule} m={m}: {json.dumps(cell)}", file=sys.stderr, flush=True)
    began = time.perf_counter()
    result["memory"] = memory_cells(args, result["hasten_error"])
    result["memory"]["seconds"] = time.perf_counter() - began
    result["seconds"] = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------- the markdown rows
def fmt(values: list[float | None], digits: int = 2) -> str:
    return " / ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)


def mean_idle(cell: dict, name: str) -> float | None:
    idle = cell["idle"].get(name)
    return None if idle is None else sum(idle) / len(idle)


def markdown_rows(r: dict) -> list[str]:
    """The rows for bench/RESULTS.md's table (# | Measure | hasten | Accelerate | Fabric | Target | Met)."""
    rows = []
    model = f"{r['model']['blocks']} blocks, {r['params'] / 1e6:.1f}M parameters, batch {r['model']['batch']}"
    where = f"{r['processes']} processes on {r['cpus']} cores, gloo"
    for schedule in sorted({k.split()[0] for k in r["cells"]}, key=SCHEDULES.index):
        cells = {int(k.split("=")[1]): c for k, c in r["cells"].items() if k.startswith(schedule + " ")}
        ms = sorted(cells)
        ratios = [None if cells[m]["step_vs_hand"] is None else cells[m]["step_vs_hand"]["median"] for m in ms]
        same = all(cells[m].get("same_loss") and cells[m].get("same_params") for m in ms if ratios[ms.index(m)])
        met = "" if None in ratios else ("yes" if max(ratios) <= 1.03 else "**no**")
        check = "same loss and parameters as the hand loop" if same else "**loss or parameters differ**"
        if None in ratios:
            check = "hasten's side failed: see the notes" if r["hasten_error"] else "hasten not run"
        hand_ms = fmt([cells[m]["hand_step_s"] * 1e3 for m in ms], 0)
        rows.append(
            f"| {ROW} | pipeline step ÷ hand-written `torch.distributed.pipelining` loop ({schedule}, 4 stages, "
            f"m = {' / '.join(map(str, ms))}; {model}, {where}; hand step {hand_ms} ms; A/A "
            f"{fmt([cells[m]['hand_again']['median'] for m in ms])}; {check}) | {fmt(ratios)} | — | — | ≤ 1.03 "
            f"| {met} |"
        )
        idle = {n: [mean_idle(cells[m], n) for m in ms] for n in ("hand", "hasten")}
        theory = fmt([cells[m]["theory_bubble"] for m in ms])
        rows.append(
            f"| {ROW} | … measured bubble, {schedule}: idle fraction of the pipeline call, mean of the 4 stages, "
            f"m = {' / '.join(map(str, ms))} (hand loop {fmt(idle['hand'])}; theory (p−1)/(m+p−1) {theory}; "
            f"the stages share {r['cpus']} cores) | {fmt(idle['hasten'])} | — | — |  |  |"
        )
    rows.append(memory_row(r))
    return rows


def memory_row(r: dict) -> str:
    mem = r["memory"]
    whole = mem["whole"]
    what = (
        f"({mem['schedule']}, m = {mem['microbatches']}; the whole model in one process: "
        f"{whole['bytes']['total'] / 1e6:.1f} MB of state, peak RSS {whole['peak_rss'] / 1e6:.0f} MB, "
        f"{(whole['peak_rss'] - whole['start_rss']) / 1e6:.0f} MB above its start"
    )
    cells = []
    for variant in ("hasten", "hand"):
        if variant not in mem:
            cells.append("n/a")
            continue
        v = mem[variant]
        cells.append(
            f"{max(v['bytes_vs_whole']):.2f}; {max(v['peak_rss_vs_whole']):.2f} "
            f"({max(v['peak_above_start_vs_whole']):.2f} above start)"
        )
    what += f"; hand loop {cells[1]})"
    return (
        f"| {ROW} | … memory per process ÷ the whole model's: parameters + gradients + AdamW state, largest "
        f"stage; peak RSS, largest process {what} | {cells[0]} | — | — |  |  |"
    )


def spread(s: dict | None) -> str:
    if s is None:
        return "n/a"
    return f"{s['median']:.3f} (quartiles {s['q1']:.3f}–{s['q3']:.3f}, n={s['n']})"


def notes_line(r: dict) -> str:
    """The note for RESULTS.md below the table: spreads, A/A, per-stage idle, CPU share, errors."""
    parts = []
    for key, c in r["cells"].items():
        idle = "; ".join(f"{n} {fmt(v)}" for n, v in c["idle"].items())
        parts.append(
            f"{key}: hasten ÷ hand {spread(c['step_vs_hand'])}, A/A {spread(c['hand_again'])}; one microbatch "
            f"alone per stage {fmt([t * 1e3 for t in c['alone_s']], 1)} ms; idle per stage {idle} (theory "
            f"{c['theory_bubble']:.2f}); CPU share per process {fmt(c['cpu_share'])}"
        )
    mem = r["memory"]
    for variant in ("hasten", "hand"):
        if variant in mem:
            v = mem[variant]
            parts.append(
                f"memory {variant} per stage: state ÷ whole {fmt(v['bytes_vs_whole'])}, peak RSS ÷ whole "
                f"{fmt(v['peak_rss_vs_whole'])}, above start {fmt(v['peak_above_start_vs_whole'])}"
            )
    for where, error in r["hasten_error"].items():
        parts.append(f"hasten's side failed ({where}): `{error.strip().splitlines()[-1]}`")
    return f"- Row {ROW} ({r['rounds']} rounds × {r['steps_per_block']} steps per block): " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--part", choices=("time", "memory", "whole"), help="one process of a launch (default: the driver)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: one small cell per schedule")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8, help="for one launch")
    parser.add_argument("--microbatches-list", default="4,8,16")
    parser.add_argument("--variant", choices=("hand", "hasten"))
    parser.add_argument("--no-hasten", dest="hasten", action="store_false", help="the hand-written loops only")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--alone-reps", type=int, default=10)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--mem-schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--mem-microbatches", type=int, default=8)
    parser.add_argument("--pg-timeout", type=float, default=120, help="hasten's process-group timeout, seconds")
    parser.add_argument("--timeout", type=float, default=600, help="per launch, seconds")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true", help="accepted for bench/run.py; nothing else is compared")
    args = parser.parse_args()
    single_thread()
    if args.part is not None:
        {"time": time_worker, "memory": memory_worker, "whole": whole_worker}[args.part](args)
        return
    if args.quick:
        args.microbatches_list, args.rounds, args.steps, args.alone_reps, args.mem_steps = "4", 1, 1, 2, 1
    args.schedules = args.schedules.split(",")
    args.microbatches_list = [int(m) for m in str(args.microbatches_list).split(",")]
    for m in args.microbatches_list:
        if args.batch % m or m < 1:
            parser.error(f"--batch {args.batch} must split into --microbatches-list's {m} equal microbatches")
    if args.blocks % PROCESSES:
        parser.error(f"--blocks must be a multiple of {PROCESSES} (an even split), got {args.blocks}")
    result = driver(args)
    emit(result, args.out)
    print("\n".join([*markdown_rows(result), "", notes_line(result)]))
    for where, error in result["hasten_error"].items():
        print(f"\nhasten's side failed ({where}):\n{error}", file=sys.stderr)


if __name__ == "__main__":
    main()
