"""save_state on a disk that fills up: the error says the OS error and the file, on every rank.

usage: fault_disk_full.py OUT (ddp | fsdp) [TMPFS]

The run saves a first checkpoint, then a second one while writing is made to fail for real:

* "fsize": on rank 0, ``RLIMIT_FSIZE`` (with SIGXFSZ ignored) caps the size of any file the
  process writes, so the kernel answers the checkpoint's bigger files with EFBIG ("File too large");
* "tmpfs" (when TMPFS, a small tmpfs mounted by the test, is given): the checkpoint goes there
  and the disk really is full (ENOSPC, "No space left on device").

Each case records the error's type and message, what is left in the folder and whether the
first checkpoint still loads to the saved weights (OUT/rank{r}.json). At the end the fsize
error is raised again, uncaught, so the test sees what the launcher shows on the console.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin

out, kind = sys.argv[1], sys.argv[2]
tmpfs = sys.argv[3] if len(sys.argv) > 3 else None
accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin() if kind == "fsdp" else None)
rank = accelerator.process_index
torch.manual_seed(0)
# 2 x 256 x 256 fp32 (+ AdamW's two moments): a checkpoint of about 1.5 MB
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(model, optimizer)


def train_step() -> None:
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}


def fail_to_save(folder: str, limit_file_size: bool) -> dict:
    """Save into ``folder`` (first checkpoint ``a`` succeeds, second ``b`` fails); what was seen."""
    rec: dict = {}
    train_step()
    first = accelerator.save_state(os.path.join(folder, "a"))
    saved = weights()
    train_step()
    if limit_file_size and rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    try:
        accelerator.save_state(os.path.join(folder, "b"))
        rec["error"] = None
    except BaseException as e:  # noqa: BLE001 - a CheckpointException of torch would not be an Exception
        rec["error"] = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        rec["exception"] = e
    finally:
        if limit_file_size and rank == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    accelerator.wait_for_everyone()
    rec["left"] = sorted(os.listdir(folder))
    accelerator.load_state(first)
    rec["first_loads"] = all(torch.equal(saved[k], v) for k, v in weights().items())
    return rec


results = {"fsize": fail_to_save(os.path.join(out, "fsize"), limit_file_size=True)}
if tmpfs:
    results["tmpfs"] = fail_to_save(tmpfs, limit_file_size=False)
errors = {case: rec.pop("exception", None) for case, rec in results.items()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
accelerator.wait_for_everyone()
if errors["fsize"] is not None:
    raise errors["fsize"]
