"""Issue 57 on S3 at 2 processes, FSDP2 (read by tests/test_reliability_round6_storage.py).

usage: round6_storage_s3.py OUT BUCKET SERVER_PID (s3fs reaches the moto server through fsspec's
environment). A checkpoint saved at ``s3://BUCKET/run/ck``; a re-save whose registered object's
``state_dict`` raises (on rank 0, which saves them), then one whose pre-hook raises on rank 1: each fails on both
ranks, the previous checkpoint's objects are as they were and it loads. Last, rank 0 kills the
server (SIGKILL) once the previous copy is deleted and before the first file is written: every
rank must raise one ``CheckpointError``, chained from the original error. Writes OUT/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.checkpoint import storage  # noqa: E402
from hasten.checkpoint.executor import Executor  # noqa: E402

out, bucket, server_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
CK = f"s3://{bucket}/run/ck"
rank = int(os.environ["RANK"])
res: dict = {"rank": rank}


class Breaks:
    fail_on: int | None = None

    def state_dict(self):
        if self.fail_on == rank:
            raise RuntimeError(f"state_dict broke on rank {rank}")
        return {"n": 1}

    def load_state_dict(self, sd):
        pass


def full_weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def train(acc, model, opt, data):
    r, n = acc.process_index, acc.num_processes
    for x, y in data:
        acc.backward(nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]))
        opt.step()
        opt.zero_grad()


def failed_resave(acc, model, opt, breaks, saved, before, cause):
    train(acc, model, opt, batches(1, seed=5))
    error = None
    try:
        if cause == "state_dict":
            breaks.fail_on = 0  # the main process saves registered objects
            acc.save_state(CK)
        else:

            def hook(models, weights, output_dir):
                if rank == 1:
                    raise RuntimeError("the pre-hook broke on rank 1")

            handle = acc.register_save_state_pre_hook(hook)
            try:
                acc.save_state(CK)
            finally:
                handle.remove()
    except Exception as e:  # noqa: BLE001 - recorded
        error = f"{type(e).__name__}: {e}"
    breaks.fail_on = None
    kept = storage.of(CK).sizes(CK)
    acc.load_state(CK)
    now = full_weights(acc, model)
    return {
        "error": error,
        "kept": kept,
        "before": before,
        "loaded_is_saved": all(torch.equal(now[k], saved[k]) for k in saved),
    }


def dead_store(acc, model, opt):
    train(acc, model, opt, batches(1, seed=6))
    write = Executor.write

    def kill_then_write(self, plan, tmp):
        if rank == 0:  # the previous copy is deleted: the store dies before the first file
            os.kill(server_pid, signal.SIGKILL)
            time.sleep(1.0)
        return write(self, plan, tmp)

    Executor.write = kill_then_write
    try:
        acc.save_state(CK)
    except BaseException as e:  # noqa: BLE001 - recorded
        return {
            "type": type(e).__name__,
            "message": str(e)[:3000],
            "chained": e.__cause__ is not None,
            "mro": [c.__name__ for c in type(e).__mro__],
        }
    finally:
        Executor.write = write
    return {"type": None, "message": "no error", "chained": False}


try:
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    model = make_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    breaks = Breaks()
    acc.register_for_checkpointing(breaks)
    train(acc, model, opt, batches(2))
    acc.save_state(CK)
    saved = full_weights(acc, model)
    before = storage.of(CK).sizes(CK)
    for cause in ("state_dict", "pre_hook"):
        res[cause] = failed_resave(acc, model, opt, breaks, saved, before, cause)
    res["dead"] = dead_store(acc, model, opt)
except Exception:  # noqa: BLE001 - recorded for the test
    res["tb"] = traceback.format_exc()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f, indent=1)
