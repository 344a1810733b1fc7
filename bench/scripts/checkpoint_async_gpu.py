"""Device check of asynchronous save_state on a GPU (one process, NCCL): not part of ``make bench``.

usage: python bench/scripts/checkpoint_async_gpu.py OUT_JSON [WIDTHS]

One process with an NCCL default group (the case that needs a CPU-capable group for async DCP),
row 8's model on the GPU with AdamW stepped once, FSDP2. Per width: a synchronous save_state,
two asynchronous ones (the first pins torch's host buffers, the second reuses them), each
asynchronous save's pause (the call, and how much longer the next training step took: its
optimizer step waits for the copy) and its time to completion, a load verified and one unverified, and
checks: the background group is gloo, the checkpoint loads back the weights saved, training
steps run while the background thread writes. Prints each figure as it comes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_memory  # noqa: E402

out_path = sys.argv[1]
widths = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048,4608").split(",")]
for k, v in {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29571",
}.items():
    os.environ.setdefault(k, v)
CUDA = torch.cuda.is_available()  # without a GPU (a dry run of this script): gloo on the CPU
if CUDA:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if CUDA else "gloo")
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.checkpoint import background  # noqa: E402

result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if CUDA else "cpu", "sizes": []}


def say(**kv) -> None:
    print(json.dumps(kv), flush=True)


def flush() -> None:
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


root = tempfile.mkdtemp(prefix="hasten-gpu-ckpt-")


def measure(width: int) -> None:
    fsdp_memory.WIDTH = width
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    model = fsdp_memory.make()
    params = sum(p.numel() for p in model.parameters())
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(fsdp_memory.BATCH, width, device=DEVICE)

    def step() -> None:
        acc.backward(nn.functional.cross_entropy(model(x), torch.randint(0, 10, (fsdp_memory.BATCH,), device=DEVICE)))
        opt.step()
        opt.zero_grad()

    step()
    sync()
    z: dict = {
        "width": width,
        "params": params,
        "backend": dist.get_backend(),
        "param_device": str(next(model.parameters()).device),
    }

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    z["sync_s"] = timed(lambda: acc.save_state(os.path.join(root, "sync")))
    say(width=width, params=params, sync_s=z["sync_s"])
    for i in (1, 2):
        path = os.path.join(root, f"async{i}")
        step_before = timed(step)
        if i == 1:  # the weights this save writes (taken after the step above, outside the timings)
            at_save = {k: v.detach().cpu().clone() for k, v in acc.get_state_dict(model).items()}
        saved = timed(lambda path=path: acc.save_state(path, async_save=True))  # called now
        start = time.perf_counter()
        # the next step's optimizer.step() waits for the copy to host memory (pinned, on a stream
        # of its own that waited for the training stream): the loop's pause is the call and how
        # much longer that step took
        z[f"async{i}_blocked_s"] = saved + max(0.0, timed(step) - step_before)
        steps = 1
        while not acc._checkpointer.background.pending.done() and steps < 3:
            step()  # the loop goes on while the thread writes (only the first check's state is compared)
            steps += 1
        acc.wait_for_checkpoint()
        z[f"async{i}_total_s"] = time.perf_counter() - start + saved
        z[f"async{i}_steps_while_writing"] = steps
        say(**{k: v for k, v in z.items() if k.startswith(f"async{i}")})
        if i == 1:
            z["background_group_backend"] = dist.get_backend(background._group[1])
            z["pinned_stager"] = acc._checkpointer.background.stager is not None
            acc.load_state(path)
            z["async_loads_the_saved_weights"] = all(
                torch.equal(at_save[k], v.detach().cpu()) for k, v in acc.get_state_dict(model).items()
            )
            say(group=z["background_group_backend"], loads_saved=z["async_loads_the_saved_weights"])
        shutil.rmtree(path, ignore_errors=True)
    z["load_verified_s"] = timed(lambda: acc.load_state(os.path.join(root, "sync")))
    z["load_unverified_s"] = timed(lambda: acc.load_state(os.path.join(root, "sync"), verify_checksums=False))
    z["async_over_sync"] = z["async2_blocked_s"] / z["sync_s"]
    z["verified_over_unverified"] = z["load_verified_s"] / z["load_unverified_s"]
    say(**z)
    result["sizes"].append(z)
    flush()
    shutil.rmtree(os.path.join(root, "sync"), ignore_errors=True)
    acc.free_memory()


for width in widths:
    try:
        measure(width)
    except Exception as e:  # noqa: BLE001 - recorded, the next width still runs
        import traceback

        result["sizes"].append(
            {"width": width, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}
        )
        say(width=width, error=f"{type(e).__name__}: {e}")
        flush()
    if CUDA:  # measure's model, optimizer and Accelerator went with its frame
        torch.cuda.empty_cache()
shutil.rmtree(root, ignore_errors=True)
flush()
dist.destroy_process_group()
