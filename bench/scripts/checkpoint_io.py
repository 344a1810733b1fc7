"""Row 11: checkpoint save and load at 2 processes, FSDP2's sharded checkpoint (DCP) ÷ one rank
writing a full state dict. Run under ``python -m torch.distributed.run --nproc_per_node 2``.

The model is row 8's ~50M-parameter transformer (fsdp_memory.py's builder), prepared with
hasten's FSDP2 (``FullyShardedDataParallelPlugin``, one ``fully_shard`` per block), AdamW
stepped once so that its state exists (parameters + 2 moments: ~600 MB in fp32).

- dcp: ``accelerator.save_state(dir)`` (the "dcp" layout: every rank writes its own shards
  with ``torch.distributed.checkpoint``, in parallel; each file fsynced and its sha256 recorded,
  then the manifest and the atomic rename) and ``accelerator.load_state(dir)`` (every file's
  sha256 verified by default, shards read by each rank, resharded if need be); also timed with
  ``verify_checksums=False`` (every rank hashes every shard file of the checkpoint by default);
- full: ``get_state_dict(model, optimizer, StateDictOptions(full_state_dict=True,
  cpu_offload=True))`` gathers the whole model and optimizer state on rank 0, which
  ``torch.save``s it to one file (fsynced); loading, rank 0 ``torch.load``s the file and
  ``set_model_state_dict``/``set_optimizer_state_dict(..., broadcast_from_rank0=True)`` send
  each rank its shards.

Each operation is timed from a barrier to a barrier (done when the slowest rank is); the
variants are interleaved round by round (the order reversed every other round), each round
in fresh folders, removed after it. Figures: DCP ÷ full per round for save and load (median
and quartiles), the absolute seconds and the bytes on disk of each. The files were just
written, so loads read them from the page cache on a machine with memory to spare.
Rank 0 writes the result.
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


def folder_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="row 8's width (1024: ~50M parameters)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    args = parser.parse_args()
    fsdp_memory.WIDTH = args.width  # the builder reads it
    single_thread()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from hasten import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    model = fsdp_memory.make()
    params = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(fsdp_memory.BATCH, args.width, generator=torch.Generator().manual_seed(acc.process_index))
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (fsdp_memory.BATCH,)))
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    raw_opt = opt.optimizer  # torch's own optimizer, for torch's state-dict functions
    rank0 = acc.is_main_process

    def local_tensors() -> list[torch.Tensor]:
        out = [getattr(p, "_local_tensor", p).detach().clone() for p in model.parameters()]
        for state in raw_opt.state.values():
            out += [
                getattr(v, "_local_tensor", v).detach().clone() for v in state.values() if isinstance(v, torch.Tensor)
            ]
        return out

    reference = local_tensors()
    restored = []  # after each load: every local shard of the parameters and optimizer state as saved

    def check() -> None:
        now = local_tensors()
        restored.append(len(now) == len(reference) and all(torch.equal(a, b) for a, b in zip(now, reference)))

    root = tempfile.mkdtemp(prefix="hasten-ckpt-io-", dir=args.dir) if rank0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def full_save(path: str) -> None:
        msd, osd = get_state_dict(model, raw_opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank0:
            with open(path, "wb") as f:
                torch.save({"model": msd, "optimizer": osd}, f)
                f.flush()
                os.fsync(f.fileno())

    def full_load(path: str) -> None:
        # Model and optimizer apart: torch's combined set_state_dict takes the empty model dict of
        # a rank other than 0 for "optimizer only" and skips the model's broadcast (a deadlock).
        state = torch.load(path, map_location="cpu", weights_only=True) if rank0 else {"model": {}, "optimizer": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, raw_opt, state["optimizer"], options=options)

    times: dict[str, list[float]] = {
        name: [] for name in ("dcp_save", "full_save", "dcp_load", "full_load", "dcp_unverified_load")
    }
    sizes: dict[str, int] = {}
    try:
        for r in range(args.rounds + 1):  # round 0: warm-up, not counted
            where = {"dcp": os.path.join(root, f"dcp_{r}"), "full": os.path.join(root, f"full_{r}.pt")}
            order = ["dcp", "full"] if r % 2 == 0 else ["full", "dcp"]
            took = {}
            for kind in order:
                took[f"{kind}_save"] = timed(
                    (lambda p=where["dcp"]: acc.save_state(p))
                    if kind == "dcp"
                    else (lambda p=where["full"]: full_save(p))
                )
            if rank0:
                sizes = {kind: folder_bytes(path) for kind, path in where.items()}
            for kind in (["dcp_unverified"] if r % 2 else []) + order[::-1] + ([] if r % 2 else ["dcp_unverified"]):
                for tensor in (*model.parameters(), *(v for st in raw_opt.state.values() for v in st.values())):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                        with torch.no_grad():
                            getattr(tensor, "_local_tensor", tensor).zero_()  # so that a load that loads nothing shows
                load = {
                    "dcp": lambda p=where["dcp"]: acc.load_state(p),
                    "dcp_unverified": lambda p=where["dcp"]: acc.load_state(p, verify_checksums=False),
                    "full": lambda p=where["full"]: full_load(p),
                }[kind]
                took[f"{kind}_load"] = timed(load)
                check()
            if r > 0:
                for name, t in took.items():
                    times[name].append(t)
            dist.barrier()
            if rank0:
                shutil.rmtree(where["dcp"], ignore_errors=True)
                os.remove(where["full"])
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(root, ignore_errors=True)

    if rank0:
        emit({
            "params": params, "processes": dist.get_world_size(), "rounds": args.rounds,
            "save_ratio": ratio_summary(times, "full_save", "dcp_save"),
            "load_ratio": ratio_summary(times, "full_load", "dcp_load"),
            "times_s": {name: summary(ts) for name, ts in times.items()},
            "bytes": sizes,
            "restored": all(restored),
        }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
