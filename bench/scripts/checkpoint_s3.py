"""Row 16: checkpoints on an S3 server ÷ on the local disk (issue 49). Run under
``python -m torch.distributed.run --nproc_per_node 2``; needs ``hasten[s3]`` and ``moto[server]``.

Rank 0 starts moto's S3 server (``python -m moto.server``) on 127.0.0.1, in a process of its own,
and makes a bucket; every process reaches it through fsspec's environment only
(``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...), as a user's run reaches a real store.
The server is on this machine: the ratios show what hasten's object-store path costs over its
disk path (fsspec, s3fs, HTTP, moto's handling of each request, and no page cache), not a network.

The model is row 13's (row 8's transformer, ``--width`` 1024: ~50M parameters, FSDP2 on 2
processes, AdamW stepped once). Per round, the variants interleaved (the order reversed every
other round), each from a barrier to a barrier, in fresh folders:

- sync disk / sync s3: ``save_state(dir)`` / ``save_state("s3://bucket/...")``;
- async disk / async s3: ``save_state(..., async_save=True)`` then the next training step, as in
  row 13: the loop's pause is the call plus how much longer that step's ``optimizer.step()``
  took than the one before (its wait for the host copy); ``wait_for_checkpoint()`` after;
- load disk / load s3: ``load_state`` (checksums verified) of the last synchronous saves.

Each folder is removed (every object deleted) once timed. Rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import fsdp_memory
import torch
import torch.distributed as dist
from _harness import emit, ratio_summary, single_thread, summary
from torch import nn

BUCKET = "hasten-bench"


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port of 127.0.0.1, with ``BUCKET`` made; (process, endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)
    return server, endpoint


def point_fsspec_at(endpoint: str) -> None:
    """fsspec's S3 configuration, as a user sets it: the environment (read when fsspec is imported)."""
    os.environ.update(
        FSSPEC_S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY="127.0.0.1,localhost",
    )
    import fsspec.config

    fsspec.config.set_conf_env(fsspec.config.conf)  # in case fsspec was imported before


def s3():
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


def measure(width: int, rounds: int, root: str) -> dict:
    from hasten import Accelerator, FullyShardedDataParallelPlugin

    fsdp_memory.WIDTH = width
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = fsdp_memory.Net()
    params = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randn(fsdp_memory.BATCH, width, generator=torch.Generator().manual_seed(acc.process_index + 1))
    labels = torch.randint(0, 10, (fsdp_memory.BATCH,))

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def step() -> float:
        acc.backward(nn.functional.cross_entropy(model(batch), labels))
        took = timed(opt.step)
        opt.zero_grad()
        return took

    def async_pause(path: str) -> float:
        before = step()
        blocked = timed(lambda: acc.save_state(path, async_save=True))
        after = step()
        acc.wait_for_checkpoint()
        return blocked + max(0.0, after - before)

    def drop(path: str) -> None:
        dist.barrier()
        if acc.is_main_process:
            s3().rm(path, recursive=True) if path.startswith("s3://") else shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    step()
    names = ("sync_disk", "sync_s3", "async_disk", "async_s3", "load_disk", "load_s3")
    times: dict[str, list[float]] = {n: [] for n in names}
    kept = {"disk": os.path.join(root, "kept"), "s3": f"s3://{BUCKET}/kept"}
    for r in range(rounds + 1):  # round 0: warm-up (plans cached, connections made), not counted
        where = {"disk": os.path.join(root, f"r{r}"), "s3": f"s3://{BUCKET}/r{r}"}
        order = ["sync_disk", "sync_s3", "async_disk", "async_s3"]
        took = {}
        for kind in order if r % 2 == 0 else order[::-1]:
            mode, store = kind.split("_")
            path = kept[store] if (mode == "sync" and r == rounds) else f"{where[store]}_{mode}"
            took[kind] = timed(lambda p=path: acc.save_state(p)) if mode == "sync" else async_pause(path)
            if path not in kept.values():
                drop(path)
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    for r in range(rounds + 1):
        order = ["load_disk", "load_s3"] if r % 2 == 0 else ["load_s3", "load_disk"]
        took = {kind: timed(lambda k=kind: acc.load_state(kept[k.split("_")[1]])) for kind in order}
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    for path in kept.values():
        drop(path)
    acc.wait_for_checkpoint()
    acc.free_memory()  # not end_training: it would end the process group this script made
    return {
        "width": width,
        "params": params,
        "rounds": rounds,
        "sync_s3_over_disk": ratio_summary(times, "sync_disk", "sync_s3"),
        "async_s3_over_disk": ratio_summary(times, "async_disk", "async_s3"),
        "load_s3_over_disk": ratio_summary(times, "load_disk", "load_s3"),
        "async_over_sync_s3": ratio_summary(times, "sync_s3", "async_s3"),
        "async_over_sync_disk": ratio_summary(times, "sync_disk", "async_disk"),
        "times_s": {n: summary(ts) for n, ts in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024, help="row 8's width (1024: ~50M parameters)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the disk checkpoints go (default: a temporary folder)")
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    args = parser.parse_args()
    single_thread()
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    server, endpoint = start_server() if rank0 else (None, None)
    holder = [endpoint, tempfile.mkdtemp(prefix="hasten-ckpt-s3-", dir=args.dir) if rank0 else None]
    dist.broadcast_object_list(holder)
    endpoint, root = holder
    point_fsspec_at(endpoint)
    try:
        if rank0:
            s3().mkdir(BUCKET)
        dist.barrier()
        result = measure(args.width, args.rounds, root)
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
            server.terminate()
            server.wait(30)
    if rank0:
        emit({"processes": dist.get_world_size(), **result, "loadavg": list(os.getloadavg())}, args.out)


if __name__ == "__main__":
    main()
