"""Row 13: checkpoints as the state grows: the loop's pause of an asynchronous ``save_state`` ÷ a
synchronous one, a synchronous one ÷ ``torch.save`` of the same state, and load with checksums
verified ÷ without. Run under ``python -m torch.distributed.run --nproc_per_node 2``.

The model is row 8's transformer (fsdp_memory.py's ``Net``) at each ``--widths`` (1024: ~50M
parameters, 2048: ~200M, 4608: ~1B), built on the meta device and prepared with hasten's FSDP2
(one ``fully_shard`` per block; each process allocates and initialises only its shards) and
AdamW stepped once, so the state is parameters + 2 moments (12 bytes a parameter in fp32), half
on each process. Per round, in fresh folders, the variants interleaved (the order reversed
every other round), each timed from a barrier to a barrier (so: the slowest process):

- sync: ``accelerator.save_state(dir)`` (each process writes its DCP shards, hashing them as it
  writes; the manifest and the atomic rename);
- async (blocked): ``accelerator.save_state(dir, async_save=True)`` until it returns on every
  process, then the next training step: its ``optimizer.step()`` waits for the background copy
  of the parameters and optimizer state to host memory (which runs beside the step's forward
  and backward), so the loop's pause is the save_state call plus how much longer that
  ``optimizer.step()`` took than the one just before the save (never counted below 0). How much
  longer the forward and backward took, beside the copy and the write on the same 2 cores, is
  in the notes (``fb_beside_async_s``); then ``wait_for_checkpoint()`` until the checkpoint is
  in place (``async_total``: from the save_state call, the training step included);
- torch.save: each process ``torch.save``s its own shards (the same tensors: local shards of the
  parameters and of the optimizer state) to a file of its own, fsynced: the bytes a checkpoint
  has to write, without DCP, the manifest, hashing or renames; twice a round (``torch_save``
  and ``torch_save_again``, first and last in the round's order), so that the A/A ratio
  ``torch_save_again`` ÷ ``torch_save`` shows how far two identical writes stray here (the
  page cache and the disk of a shared VM);
- dcp alone (in the notes): ``torch.distributed.checkpoint.save`` of the same model and optimizer
  state dicts with torch's plain ``FileSystemWriter``: no hashing, no other files, no manifest or
  rename; what ``save_state`` adds to DCP is sync ÷ this;
- load verified / unverified: ``load_state(dir)`` and ``load_state(dir, verify_checksums=False)``
  of the synchronous save (each process verifies the items it reads, as it reads them), twice
  each in the order A B B A, the faster of the two.

The saves of every round come first, then the loads of every round (of the last synchronous
save), as in training: a load at the start, saves all along. Each folder is removed once timed,
so that one variant's files do not crowd another's turn; before the loads every file is read
once, so both loads read from the page cache. Last, one asynchronous save right after a load
(``async_after_load_s``): a load replaces the optimizer's state tensors, so that save stages
into new host memory. A size
whose estimated memory (``--budget-gb``; the state, the model every process builds before
the async host copy, the tensors a load reads into) does not fit runs the saves alone (sync,
torch.save twice, DCP alone: the training state is all they need), and a size where those do
not fit either is left out, with the reason (``--saves-only`` runs the saves alone at the
widths it names). Rank 0 writes the result, with the speed of each checksum on one core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import fsdp_memory
import torch
import torch.distributed as dist
from _harness import emit, ratio_summary, single_thread, summary
from torch import nn

# Estimated bytes per parameter, all processes together (the model is built on the meta device:
# only shards are ever allocated): the parameters, gradients and two moments (16), the async
# save's host copy of the parameters and moments (12, kept between saves) and the new tensors
# load_state reads into (12); the saves alone need the training state only. Plus what each
# process holds whatever the model (the interpreter, torch, activations), in GB.
BYTES_ALL, BYTES_SAVES, GB_PER_PROCESS = 16.0 + 12.0 + 12.0, 16.0, 1.5


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 1e6


def measure(width: int, rounds: int, root: str, saves_only: str | None = None) -> dict:
    """Every variant at ``width``; with ``saves_only`` (the reason), the saves alone."""
    from hasten import Accelerator, FullyShardedDataParallelPlugin

    fsdp_memory.WIDTH = width
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = fsdp_memory.Net()
    params = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(fsdp_memory.BATCH, width, generator=torch.Generator().manual_seed(acc.process_index))
    acc.backward(nn.functional.cross_entropy(model(x), torch.randint(0, 10, (fsdp_memory.BATCH,))))
    opt.step()
    opt.zero_grad()
    raw_opt = opt.optimizer
    rank = acc.process_index

    def local_state() -> dict:
        return {
            "model": {n: getattr(p, "_local_tensor", p).detach() for n, p in model.named_parameters()},
            "optimizer": {i: {k: getattr(v, "_local_tensor", v) for k, v in st.items()}
                          for i, st in enumerate(raw_opt.state.values())},
        }  # fmt: skip

    def torch_save(path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f"rank_{rank}.pt"), "wb") as f:
            torch.save(local_state(), f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_alone(path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(path, "model"))
        dcp.save(get_optimizer_state_dict(model, raw_opt), checkpoint_id=os.path.join(path, "optimizer"))

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    batch = torch.randn(fsdp_memory.BATCH, width, generator=torch.Generator().manual_seed(rank + 1))
    labels = torch.randint(0, 10, (fsdp_memory.BATCH,))

    def step() -> tuple[float, float]:
        """One training step: (forward and backward, optimizer.step) in seconds."""
        fb = timed(lambda: acc.backward(nn.functional.cross_entropy(model(batch), labels)))
        st = timed(opt.step)
        opt.zero_grad()
        return fb, st

    def async_save(path: str) -> tuple[float, float, float]:
        """(the loop's pause, the forward and backward's extra time beside the background work, the total)."""
        fb_before, step_before = step()
        start = time.perf_counter()
        blocked = timed(lambda: acc.save_state(path, async_save=True))
        fb, st = step()
        acc.wait_for_checkpoint()
        dist.barrier()
        return blocked + max(0.0, st - step_before), fb - fb_before, time.perf_counter() - start

    names = (
        "sync",
        "async_blocked",
        "async_total",
        "fb_beside_async",
        "torch_save",
        "torch_save_again",
        "dcp_alone",
        "load_verified",
        "load_unverified",
    )
    if saves_only:
        names = ("sync", "torch_save", "torch_save_again", "dcp_alone")
    times: dict[str, list[float]] = {n: [] for n in names}
    # Saves first, every round, then loads, every round, as a training run does (a load at the
    # start, saves all along): a load_state replaces the optimizer's state tensors, so the first
    # asynchronous save after it stages into new host memory (torch's stager keys its buffers by
    # storage), measured once at the end (async_after_load).
    kept = os.path.join(root, f"sync_{width}_last")
    for r in range(rounds + 1):  # round 0: warm-up (plans cached, pages touched), not counted
        where = {k: os.path.join(root, f"{k}_{width}_{r}") for k in ("sync", "async", "torch", "torch_again", "dcp")}
        if r == rounds:
            where["sync"] = kept
        took: dict[str, float] = {}
        order = ["torch", "sync", "async", "dcp", "torch_again"]
        if saves_only:
            order.remove("async")
        if r % 2:
            order.reverse()

        # drop and the lambdas below run within this round: they bind this round's ``where``
        def drop(kind: str, where: dict[str, str] = where) -> None:
            dist.barrier()
            if acc.is_main_process and where[kind] != kept:
                shutil.rmtree(where[kind], ignore_errors=True)

        for kind in order:
            if kind == "sync":
                took["sync"] = timed(lambda where=where: acc.save_state(where["sync"]))
                drop("sync")
            elif kind == "async":
                took["async_blocked"], took["fb_beside_async"], took["async_total"] = async_save(where["async"])
                drop("async")
            elif kind in ("torch", "torch_again"):
                took["torch_save" if kind == "torch" else "torch_save_again"] = timed(
                    lambda k=kind, where=where: torch_save(where[k])
                )
                drop(kind)
            else:
                took["dcp_alone"] = timed(lambda where=where: dcp_alone(where["dcp"]))
                drop("dcp")
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    if saves_only:
        return finish(
            acc,
            model,
            raw_opt,
            kept,
            times,
            {"width": width, "params": params, "rounds": rounds, "saves_only": saves_only},
        )
    if acc.is_main_process:
        warm(kept)
    for r in range(rounds + 1):
        # A B B A (A and B swapped every other round), the faster of each variant's two loads:
        # here a load_state is at times 2-4x slower whatever it verifies (the new tensors it reads
        # into are fresh memory, whose page faults cost ~3 s/GB in this VM, or memory an earlier
        # load freed), so each variant gets two chances at the same state of memory.
        took = {}
        first, second = ("load_verified", "load_unverified")[:: 1 if r % 2 == 0 else -1]
        for kind in (first, second, second, first):
            t = timed(lambda v=kind == "load_verified": acc.load_state(kept, verify_checksums=v))
            took[kind] = min(took.get(kind, t), t)
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    after_load = async_save(os.path.join(root, f"after_load_{width}"))[0]
    if acc.is_main_process:
        shutil.rmtree(os.path.join(root, f"after_load_{width}"), ignore_errors=True)
    return finish(acc, model, raw_opt, kept, times, {
        "width": width, "params": params, "rounds": rounds,
        "async_over_sync": ratio_summary(times, "sync", "async_blocked"),
        "verified_over_unverified": ratio_summary(times, "load_unverified", "load_verified"),
        "async_after_load_s": after_load,
    })  # fmt: skip


def finish(acc, model, raw_opt, kept: str, times: dict[str, list[float]], result: dict) -> dict:
    """``result`` with the ratios every size has, the times and the state's size; the kept folder removed."""
    if acc.is_main_process:
        shutil.rmtree(kept, ignore_errors=True)
    dist.barrier()
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    local += [
        getattr(v, "_local_tensor", v)
        for st in raw_opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]
    total = [None] * dist.get_world_size()
    dist.all_gather_object(total, sum(t.numel() * t.element_size() for t in local))
    acc.free_memory()
    return {
        **result, "state_bytes": sum(total),
        "sync_over_torch_save": ratio_summary(times, "torch_save", "sync"),
        "torch_save_a_a": ratio_summary(times, "torch_save", "torch_save_again"),
        "sync_over_dcp_alone": ratio_summary(times, "dcp_alone", "sync"),
        "times_s": {n: summary(ts) for n, ts in times.items()},
    }  # fmt: skip


def warm(folder: str) -> None:
    """Read every file under ``folder`` once (into the page cache)."""
    buf = bytearray(1 << 22)
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1024,2048,4608", help="row 8's widths (~50M, ~200M, ~1B parameters)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--big-rounds", type=int, default=2, help="rounds for sizes of 500M parameters and more")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="memory for both processes (default: MemAvailable)"
    )
    parser.add_argument(
        "--saves-only", default="", help="widths to measure the saves alone at (no async save, no loads)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    args = parser.parse_args()
    single_thread()
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    budget = args.budget_gb if args.budget_gb is not None else available_gb()
    holder = [tempfile.mkdtemp(prefix="hasten-ckpt-async-", dir=args.dir) if rank0 else None, budget]
    dist.broadcast_object_list(holder)
    root, budget = holder
    sizes, skipped = [], []
    try:
        for width in (int(w) for w in args.widths.split(",")):
            params = fsdp_memory.params_at(width)
            extra = GB_PER_PROCESS * dist.get_world_size()
            need_all, need_saves = params * BYTES_ALL / 1e9 + extra, params * BYTES_SAVES / 1e9 + extra
            rounds = args.big_rounds if params >= 5e8 else args.rounds
            if str(width) in args.saves_only.split(","):
                sizes.append(measure(width, rounds, root, saves_only="asked for with --saves-only"))
            elif need_all <= budget:
                sizes.append(measure(width, rounds, root))
            elif need_saves <= budget:
                reason = (
                    f"the async save's host copy and the load's tensors need ~{need_all:.0f} GB, {budget:.0f} GB "
                    "available"
                )
                sizes.append(measure(width, rounds, root, saves_only=reason))
            else:
                skipped.append(
                    {
                        "width": width,
                        "params": params,
                        "reason": f"needs ~{need_saves:.0f} GB, {budget:.0f} GB available",
                    }
                )
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
    if rank0:
        from hasten.checkpoint.checksums import hasher

        data = os.urandom(1 << 26)
        speeds = {}
        for algorithm in ("xxh3_128", "sha256"):
            h = hasher(algorithm)
            start = time.perf_counter()
            h.update(data)
            speeds[algorithm] = len(data) / 1e9 / (time.perf_counter() - start)
        load = os.getloadavg()
        emit(
            {
                "processes": dist.get_world_size(),
                "sizes": sizes,
                "skipped": skipped,
                "loadavg": list(load),
                "checksum_gb_s": speeds,
                "dir": os.path.dirname(root),
            },
            args.out,
        )


if __name__ == "__main__":
    main()
