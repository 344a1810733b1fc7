"""save_state/load_state to an S3 server (moto, on 127.0.0.1) in one launch (read by
tests/test_checkpoint_storage.py).

usage: storage_s3.py OUT BUCKET (2 processes, ``--max_restarts 1``; s3fs reaches the server
through fsspec's environment: ``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...)

First attempt: FSDP2 saves of one state to S3, synchronous and asynchronous, and to the local
disk (the manifests' records must be the same); each loaded back after more training; automatic
naming with ``total_limit`` at an S3 ``project_dir`` (asynchronous saves); a checkpoint missing
one object refused by name on every process, nothing changed; then rank 0 is SIGKILLed inside the
background write of checkpoint_1 of ``s3://BUCKET/killed``. The second attempt resumes: the
partial folder is passed over, checkpoint_0 loads, the next save removes the partial one.
Each attempt writes OUT/attempt{N}_rank{R}.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.checkpoint import background  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402

out, bucket = sys.argv[1], sys.argv[2]
S3 = f"s3://{bucket}"
DATA = batches(8)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
res: dict = {"attempt": attempt, "rank": rank}


def s3():
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


def listing(url: str) -> list[str]:
    """The names in ``url`` (folders and objects), as the store lists them now."""
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in s3().ls(url, detail=False))


def setup(**kwargs):
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]), **kwargs)
    model = make_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train(acc, model, opt, data):
    r, n = acc.process_index, acc.num_processes
    for x, y in data:
        acc.backward(nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]))
        opt.step()
        opt.zero_grad()


def full_weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def check(name, fn):
    try:
        res[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}


def write_results():
    with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


def sync_and_async():
    acc, model, opt = setup()
    train(acc, model, opt, DATA[:2])
    at_save = full_weights(acc, model)
    info = acc.save_state(f"{S3}/run/sync")
    acc.save_state(os.path.join(out, "local"))
    background.before_write = lambda tmp: time.sleep(0.3)  # a slow upload: save_state returns first
    acc.save_state(f"{S3}/run/async", async_save=True)
    returned_before_manifest = not s3().exists(f"{S3}/run/async/hasten_checkpoint.json")
    train(acc, model, opt, DATA[2:4])  # the loop goes on while the thread uploads
    acc.wait_for_checkpoint()
    background.before_write = None
    got = {"info": info, "returned_before_manifest": returned_before_manifest}
    for name in ("sync", "async"):
        acc.load_state(f"{S3}/run/{name}")
        got[f"{name}_loaded_is_at_save"] = same(at_save, full_weights(acc, model))
        train(acc, model, opt, DATA[4:5])
    with s3().open(f"{S3}/run/sync/hasten_checkpoint.json", "rb") as f:
        remote = json.load(f)["files"]
    with open(os.path.join(out, "local", "hasten_checkpoint.json")) as f:
        local = json.load(f)["files"]
    got["records_differ"] = sorted(k for k in local.keys() | remote.keys() if local.get(k) != remote.get(k))
    got["files"] = sorted(remote)
    got["no_local_s3_folder"] = not os.path.exists("s3:") and not os.path.exists(os.path.join(out, "s3:"))
    acc.wait_for_checkpoint()  # the process group stays: the next check makes its own Accelerator
    return got


def rotation():
    project = f"{S3}/auto"
    acc, model, opt = setup(project_config=ProjectConfiguration(project_dir=project, async_save=True, total_limit=2))
    for i in range(3):
        train(acc, model, opt, DATA[i : i + 1])
        acc.save_state()
    at_last = full_weights(acc, model)
    acc.wait_for_checkpoint()
    left = listing(f"{project}/checkpoints")
    train(acc, model, opt, DATA[4:5])
    info = acc.load_state()
    loaded = same(at_last, full_weights(acc, model))
    acc.wait_for_checkpoint()  # the process group stays: the next check makes its own Accelerator
    return {"left": left, "loaded": info, "loaded_is_last": loaded}


def missing_object():
    import torch.distributed as dist

    acc, model, opt = setup()
    ck = f"{S3}/run/missing"
    acc.save_state(ck)
    if acc.is_main_process:
        s3().rm(f"{ck}/model_0/__1_0.distcp")  # the shard process 1 wrote
    dist.barrier()
    before = full_weights(acc, model)
    try:
        acc.load_state(ck)
        got = {"error": None}
    except Exception as e:  # noqa: BLE001
        got = {"error": f"{type(e).__name__}: {e}"}
    got["unchanged"] = same(before, full_weights(acc, model))
    acc.wait_for_checkpoint()  # the process group stays: the next check makes its own Accelerator
    return got


def kill_mid_save():
    project = f"{S3}/killed"
    acc, model, opt = setup(project_config=ProjectConfiguration(project_dir=project, async_save=True))
    train(acc, model, opt, DATA[:2])
    acc.save_state()
    acc.wait_for_checkpoint()
    torch.save(full_weights(acc, model), os.path.join(out, f"kill_at_save_rank{rank}.pt"))
    train(acc, model, opt, DATA[2:4])
    write_results()  # this attempt's results, before the kill
    calls = []

    def kill(tmp: str) -> None:  # called before each folder's write: model_0, then optimizer_0
        calls.append(tmp)
        if rank == 0 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the main process dies with the model uploaded, mid-checkpoint

    background.before_write = kill
    acc.save_state()
    acc.wait_for_checkpoint()  # rank 1 fails here (its peer is gone); the launcher restarts both
    res["not_killed"] = True
    write_results()


def resume_after_kill():
    project = f"{S3}/killed"
    root = f"{project}/checkpoints"
    found = listing(root)
    partial = {"files": listing(f"{root}/checkpoint_1") if "checkpoint_1" in found else []}
    acc, model, opt = setup(project_config=ProjectConfiguration(project_dir=project, async_save=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = acc.load_state()
    passed_over = [str(w.message) for w in caught if "passed over" in str(w.message)]
    saved = torch.load(os.path.join(out, f"kill_at_save_rank{rank}.pt"))
    loaded_is_saved = same(saved, full_weights(acc, model))
    acc.save_state()
    acc.wait_for_checkpoint()
    left = listing(root)
    acc.wait_for_checkpoint()  # the process group stays: the next check makes its own Accelerator
    return {
        "found": found,
        "partial": partial,
        "passed_over": passed_over,
        "loaded": info,
        "loaded_is_saved": loaded_is_saved,
        "left": left,
    }


if attempt == 0:
    check("sync_async", sync_and_async)
    check("rotation", rotation)
    check("missing", missing_object)
    kill_mid_save()
else:
    check("resume", resume_after_kill)
    write_results()
