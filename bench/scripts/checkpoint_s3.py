"""Row 16: checkpoints on an S3 server ÷ torch's own ways to the same server (issues 49, 57). Run
under ``python -m torch.distributed.run --nproc_per_node 2``; needs ``hasten[s3]`` and ``moto[server]``.

Rank 0 starts moto's S3 server (``python -m moto.server``) on 127.0.0.1, in a process of its own,
and makes a bucket; every process reaches it through fsspec's environment only
(``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...), as a user's run reaches a real store.
The server is on this machine, one Python process: it, not the disk, sets the pace, so hasten's
save and load are compared with torch's own ways to the same server, in the same run.

The model is row 13's (row 8's transformer, FSDP2 on 2 processes, AdamW stepped once), at each of
``--widths`` (the state, parameters and both moments, is 576 bytes x width²: 336, 672, 1344 give
~64 MB, ~256 MB, ~1 GB). Per round, the arms interleaved (the order reversed every other round),
each from a barrier to a barrier, in fresh folders, each folder removed (every object deleted)
once timed:

- sync disk / sync s3: ``save_state(dir)`` / ``save_state("s3://bucket/...")``;
- async disk / async s3: ``save_state(..., async_save=True)`` then the next training step, as in
  row 13: the loop's pause is the call plus how much longer that step's ``optimizer.step()``
  took than the one before (its wait for the host copy); ``wait_for_checkpoint()`` after;
- dcp s3: ``torch.distributed.checkpoint.save`` of the model's and the optimizer's state dicts
  with DCP's ``FsspecWriter`` (what ``save_state`` writes, without hasten's hashing, manifest,
  extra files or replacing the previous copy);
- pipe s3 (twice, ``pipe_s3_again`` the A/A control): one ``fs.pipe()`` per process of its shards
  serialized beforehand (``torch.save`` into memory): the upload alone, s3fs's concurrent
  multipart upload;
- save pipe s3: ``torch.save`` into a buffer then one ``fs.pipe()``: Lightning 2.6.5's remote save;

then the loads of every round, of the last round's saves: ``load_state`` (verified) from disk and
from S3, DCP's ``FsspecReader`` into the same state dicts, one ``fs.cat()`` of the piped object
(twice, the A/A control: the download alone). ``--profile`` counts every request each process
sends to S3 (aiobotocore's client) in each arm's last round. Rank 0 writes the result.
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


class S3Calls:
    """Every request this process sends to S3 (``--profile``): its operation, the bytes of its
    body and when it ran, so a save can be read as requests (how many, how large, one at a time
    or several at once). Counted where every s3fs call ends: aiobotocore's client."""

    def __init__(self) -> None:
        from aiobotocore.client import AioBaseClient

        self.calls: list[tuple[str, int, float, float]] = []
        original, calls = AioBaseClient._make_api_call, self.calls

        async def counted(client, operation, params):
            body = params.get("Body")
            size = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0
            start = time.perf_counter()
            try:
                return await original(client, operation, params)
            finally:
                calls.append((str(operation), size, start, time.perf_counter()))

        AioBaseClient._make_api_call = counted

    def take(self) -> dict:
        """What was sent since the last ``take``: requests by method, the body sizes of the
        uploads, and the most requests in flight at once."""
        calls, self.calls[:] = list(self.calls), []
        by_method: dict[str, int] = {}
        for method, _, _, _ in calls:
            by_method[method] = by_method.get(method, 0) + 1
        edges = sorted([(s, 1) for _, _, s, _ in calls] + [(e, -1) for _, _, _, e in calls])
        most = level = 0
        for _, step in edges:
            level += step
            most = max(most, level)
        parts = [size for method, size, _, _ in calls if size]
        return {"requests": by_method, "upload_mb": [round(x / 1e6, 1) for x in parts], "most_at_once": most}


def state_bytes(model, raw_opt) -> int:
    """Bytes of this process's shards: parameters and optimizer state."""
    tensors = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    tensors += [getattr(v, "_local_tensor", v) for st in raw_opt.state.values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def torch_arms(model, raw_opt, rank: int) -> dict:
    """torch's own ways to the same server, each a function of a folder URL: DCP's fsspec writer
    and reader of the model's and the optimizer's state dicts (what ``save_state`` writes, without
    hasten's hashing, manifest or replacing), one ``fs.pipe()`` of this process's shards already
    serialized (the upload alone) and ``torch.save`` to a buffer then one ``fs.pipe()`` (Lightning
    2.6.5's remote save), one ``fs.cat()`` of the piped object (the download alone)."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def local_state() -> dict:
        return {
            "model": {n: getattr(p, "_local_tensor", p).detach() for n, p in model.named_parameters()},
            "optimizer": {i: {k: getattr(v, "_local_tensor", v) for k, v in st.items()}
                          for i, st in enumerate(raw_opt.state.values())},
        }  # fmt: skip

    def serialized() -> bytes:
        buf = io.BytesIO()
        torch.save(local_state(), buf)
        return buf.getvalue()

    blob = serialized()

    def dcp_save(url: str) -> None:
        dcp.save(get_model_state_dict(model), storage_writer=FsspecWriter(f"{url}/model"))
        dcp.save(get_optimizer_state_dict(model, raw_opt), storage_writer=FsspecWriter(f"{url}/optimizer"))

    def dcp_load(url: str) -> None:
        dcp.load(get_model_state_dict(model), storage_reader=FsspecReader(f"{url}/model"))
        dcp.load(get_optimizer_state_dict(model, raw_opt), storage_reader=FsspecReader(f"{url}/optimizer"))

    def cat(url: str) -> None:
        if len(s3().cat_file(f"{url}/rank_{rank}.pt")) != len(blob):
            raise RuntimeError("fs.cat() read back another size than was piped")

    return {
        "bytes": len(blob),
        "dcp_s3": dcp_save,
        "pipe_s3": lambda url: s3().pipe_file(f"{url}/rank_{rank}.pt", blob),
        "save_pipe_s3": lambda url: s3().pipe_file(f"{url}/rank_{rank}.pt", serialized()),
        "dcp_load_s3": dcp_load,
        "cat_s3": cat,
    }


SAVES = ("sync_disk", "sync_s3", "async_disk", "async_s3", "dcp_s3", "pipe_s3", "save_pipe_s3", "pipe_s3_again")
LOADS = ("load_disk", "load_s3", "dcp_load_s3", "cat_s3", "cat_s3_again")
# What each timed arm leaves behind for the loads (the last round's): the folder it is kept in.
KEPT_BY = {"sync_disk": "disk", "sync_s3": "s3", "dcp_s3": "dcp", "pipe_s3": "pipe"}


def measure(width: int, rounds: int, root: str, profile: bool) -> dict:
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
    calls = S3Calls() if profile else None

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
    torch_way = torch_arms(model, opt.optimizer, acc.process_index)
    arms = {
        "sync": lambda p: acc.save_state(p),
        "async": async_pause,
        **{k: torch_way[k.replace("_again", "")] for k in SAVES[4:] + LOADS[2:]},
        "load": lambda p: acc.load_state(p),
    }
    ctx = (acc, timed, drop, arms, calls)
    times, requests = run_rounds(ctx, width, rounds, root)
    acc.wait_for_checkpoint()
    acc.free_memory()  # not end_training: it would end the process group this script made
    mine = torch.tensor([state_bytes(model, opt.optimizer), torch_way["bytes"]], dtype=torch.float64)
    dist.all_reduce(mine)
    return report(width, params, rounds, times, requests, mine.tolist())


def run_rounds(ctx, width: int, rounds: int, root: str) -> tuple[dict, dict]:
    """The saves of every round (interleaved, the order reversed every other round), then the
    loads of every round from the last round's saves; seconds per arm per counted round, and
    (``--profile``) the requests of each arm's last round."""
    acc, timed, drop, arms, calls = ctx
    times: dict[str, list[float]] = {n: [] for n in SAVES + LOADS}
    requests: dict[str, dict] = {}
    tag = f"w{width}"
    kept = {
        "disk": os.path.join(root, f"{tag}_kept"),
        **{k: f"s3://{BUCKET}/{tag}_kept_{k}" for k in ("s3", "dcp", "pipe")},
    }
    for r in range(rounds + 1):  # round 0: warm-up (plans cached, connections made), not counted
        took = {}
        for name in SAVES if r % 2 == 0 else SAVES[::-1]:
            keep = KEPT_BY.get(name) if r == rounds else None
            path = (
                kept[keep]
                if keep
                else (
                    os.path.join(root, f"{tag}_r{r}_{name}") if "disk" in name else f"s3://{BUCKET}/{tag}_r{r}_{name}"
                )
            )
            mode = name.split("_")[0]
            fn = arms[mode] if mode in ("sync", "async") else arms[name]
            if calls is not None:
                calls.take()
            took[name] = fn(path) if mode == "async" else timed(lambda f=fn, p=path: f(p))
            if calls is not None and r == rounds:
                requests[name] = calls.take()
            if not keep:
                drop(path)
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    source = {"load_disk": kept["disk"], "load_s3": kept["s3"], "dcp_load_s3": kept["dcp"], "cat_s3": kept["pipe"]}
    source["cat_s3_again"] = kept["pipe"]
    for r in range(rounds + 1):
        took = {}
        for name in LOADS if r % 2 == 0 else LOADS[::-1]:
            fn = arms["load"] if name.startswith("load_") else arms[name]
            if calls is not None:
                calls.take()
            took[name] = timed(lambda f=fn, p=source[name]: f(p))
            if calls is not None and r == rounds:
                requests[name] = calls.take()
        if r > 0:
            for n, t in took.items():
                times[n].append(t)
    for path in kept.values():
        drop(path)
    return times, requests


def report(width: int, params: int, rounds: int, times: dict, requests: dict, sizes: list[float]) -> dict:
    """One size's figures: each arm's seconds, and hasten's over each of torch's (and the A/A)."""
    best_save = min(("dcp_s3", "pipe_s3", "save_pipe_s3"), key=lambda n: summary(times[n])["median"])
    best_load = min(("dcp_load_s3", "cat_s3"), key=lambda n: summary(times[n])["median"])
    return {
        "width": width,
        "params": params,
        "rounds": rounds,
        "state_mb": sizes[0] / 1e6,
        "serialized_mb": sizes[1] / 1e6,
        "sync_s3_over_disk": ratio_summary(times, "sync_disk", "sync_s3"),
        "async_s3_over_disk": ratio_summary(times, "async_disk", "async_s3"),
        "load_s3_over_disk": ratio_summary(times, "load_disk", "load_s3"),
        "async_over_sync_s3": ratio_summary(times, "sync_s3", "async_s3"),
        "async_over_sync_disk": ratio_summary(times, "sync_disk", "async_disk"),
        "sync_s3_over_dcp": ratio_summary(times, "dcp_s3", "sync_s3"),
        "sync_s3_over_pipe": ratio_summary(times, "pipe_s3", "sync_s3"),
        "sync_s3_over_save_pipe": ratio_summary(times, "save_pipe_s3", "sync_s3"),
        "pipe_aa": ratio_summary(times, "pipe_s3", "pipe_s3_again"),
        "load_s3_over_dcp": ratio_summary(times, "dcp_load_s3", "load_s3"),
        "load_s3_over_cat": ratio_summary(times, "cat_s3", "load_s3"),
        "cat_aa": ratio_summary(times, "cat_s3", "cat_s3_again"),
        "best_save": best_save,
        "sync_s3_over_best": ratio_summary(times, best_save, "sync_s3"),
        "best_load": best_load,
        "load_s3_over_best": ratio_summary(times, best_load, "load_s3"),
        "times_s": {n: summary(ts) for n, ts in times.items()},
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--widths", default="336,672,1344", help="row 8's widths (state of ~64 MB, ~256 MB, ~1 GB: 576 bytes x width²)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="count s3fs's requests of each arm's last round")
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
        sizes = [measure(int(w), args.rounds, root, args.profile) for w in args.widths.split(",")]
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
            server.terminate()
            server.wait(30)
    if rank0:
        emit({"processes": dist.get_world_size(), "sizes": sizes, "loadavg": list(os.getloadavg())}, args.out)


if __name__ == "__main__":
    main()
