"""Asynchronous save_state checks in one launch (read by tests/test_checkpoint_async.py).

usage: checkpoint_async.py OUT (checks | load)

* checks (2 processes, under ``--max_restarts 1``). First attempt: FSDP2 and DDP saves, each
  synchronous and asynchronous of the same state; training goes on while the background
  thread writes (its writes are made slow by ``background.before_write``, its copy of the
  parameters and optimizer state by ``background.before_stage``: the next optimizer step
  waits for it; a buffer changes in every forward); two saves in a
  row; automatic naming with total_limit; a damaged shard refused by name; then rank 0 is
  SIGKILLed inside the background write of checkpoint_1 of ``OUT/project``. The second
  attempt resumes: the partial save is passed over, checkpoint_0 loads, the next save cleans it.
  Each attempt writes OUT/attempt{N}_rank{R}.json; tensors go to OUT/*.pt.
* load (any number of processes): load OUT/async_fsdp, write its full weights to
  OUT/loaded_{N}.pt.
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
from fsdp_common import batches, counting_forwards, make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.checkpoint import background  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
DATA = batches(8)


def setup(fsdp: bool, **kwargs):
    acc = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]) if fsdp else None, **kwargs
    )
    model = counting_forwards(make_model(seed=3))  # a buffer changes in forward: an async save copies it at once
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train(acc, model, opt, data):
    r, n = acc.process_index, acc.num_processes
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def full_weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


def slow(seconds: float):
    def hook(tmp: str) -> None:
        time.sleep(seconds)

    return hook


if phase == "load":
    acc, model, opt = setup(True)
    acc.load_state(os.path.join(out, "async_fsdp"))
    weights = full_weights(acc, model)
    if acc.is_main_process:
        torch.save(weights, os.path.join(out, f"loaded_{acc.num_processes}.pt"))
    acc.end_training()
    sys.exit(0)

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
res: dict = {"attempt": attempt, "rank": rank}


def check(name, fn):
    try:
        res[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}


def write_results():
    with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)


def fsdp_and_ddp():
    for kind in ("fsdp", "ddp"):
        acc, model, opt = setup(kind == "fsdp")
        train(acc, model, opt, DATA[:3])
        at_save = full_weights(acc, model)
        acc.save_state(os.path.join(out, f"sync_{kind}"))
        background.before_write = slow(0.3)
        # the parameters and optimizer state are copied in the writer thread, slowly here: the next
        # step must wait (the hook runs during this save; it binds this iteration's list)
        copied = []
        background.before_stage = lambda copied=copied: (time.sleep(0.4), copied.append(True))
        acc.save_state(os.path.join(out, f"async_{kind}"), async_save=True)
        copied_on_return = bool(copied)
        target_existed = os.path.exists(os.path.join(out, f"async_{kind}"))
        train(acc, model, opt, DATA[3:5])  # the loop goes on (collectives too) while the thread writes
        copied_before_end_of_step = bool(copied)
        background.before_stage = None
        after = full_weights(acc, model)
        acc.wait_for_checkpoint()
        background.before_write = None
        if acc.is_main_process:
            torch.save(at_save, os.path.join(out, f"weights_at_save_{kind}.pt"))
        changed = any(not torch.equal(at_save[k], after[k]) for k in at_save)
        res[kind] = {
            "target_existed_on_return": target_existed,
            "trained_while_writing": changed,
            "copied_on_return": copied_on_return,
            "copied_before_end_of_step": copied_before_end_of_step,
            "buffer_changed": "forwards" in at_save and not torch.equal(at_save["forwards"], after["forwards"]),
            "exists_after_wait": os.path.isfile(os.path.join(out, f"async_{kind}", "hasten_checkpoint.json")),
        }
        # the same Accelerator loads it back (at 2 processes): the weights at the save
        acc.load_state(os.path.join(out, f"async_{kind}"))
        loaded = full_weights(acc, model)
        res[kind]["loaded_is_at_save"] = all(torch.equal(loaded[k], at_save[k]) for k in at_save)
        if kind == "fsdp":
            two_in_a_row(acc, model, opt)
            damaged(acc, model, opt)


def two_in_a_row(acc, model, opt):
    background.before_write = slow(0.5)
    first, second = os.path.join(out, "row_a"), os.path.join(out, "row_b")
    acc.save_state(first, async_save=True)
    a_existed_before = os.path.exists(first)
    train(acc, model, opt, DATA[5:6])
    acc.save_state(second, async_save=True)  # waits for the first
    res["row"] = {
        "a_before": a_existed_before,
        "a_when_b_returned": os.path.isfile(os.path.join(first, "hasten_checkpoint.json")),
        "b_when_b_returned": os.path.exists(second),
    }
    acc.wait_for_checkpoint()
    background.before_write = None
    res["row"]["b_after_wait"] = os.path.isfile(os.path.join(second, "hasten_checkpoint.json"))


def damaged(acc, model, opt):
    import shutil

    import torch.distributed as dist

    ck = os.path.join(out, "damaged")
    if acc.is_main_process:
        shutil.copytree(os.path.join(out, "async_fsdp"), ck)
        shard = os.path.join(ck, "model_0", "__1_0.distcp")  # the shard process 1 reads
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(shard, "wb").write(bytes(data))
    dist.barrier()
    before = full_weights(acc, model)
    try:
        acc.load_state(ck)
        res["damaged"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        res["damaged"] = {"error": f"{type(e).__name__}: {e}"}
    after = full_weights(acc, model)
    res["damaged"]["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)


def automatic_naming():
    project = os.path.join(out, "auto")
    acc, model, opt = setup(
        True, project_config=ProjectConfiguration(project_dir=project, async_save=True, total_limit=2)
    )
    for i in range(3):
        train(acc, model, opt, DATA[i : i + 1])
        acc.save_state()
    acc.wait_for_checkpoint()
    root = os.path.join(project, "checkpoints")
    res["auto"] = sorted(e for e in os.listdir(root) if not e.startswith(".hasten-lock"))


def kill_in_background_write():
    project = os.path.join(out, "project")
    acc, model, opt = setup(True, project_config=ProjectConfiguration(project_dir=project, async_save=True))
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
            os.kill(os.getpid(), signal.SIGKILL)  # the main process dies with the model written, mid-checkpoint

    background.before_write = kill
    acc.save_state()
    acc.wait_for_checkpoint()  # rank 1 fails here (its peer is gone); the launcher restarts both
    res["not_killed"] = True
    write_results()


def resume_after_kill():
    project = os.path.join(out, "project")
    root = os.path.join(project, "checkpoints")
    res["found"] = sorted(e for e in os.listdir(root) if e != ".hasten-lock")
    partial = [os.path.join(root, e) for e in res["found"] if e.startswith(".checkpoint_1.tmp-")]
    res["partial"] = [
        {
            "manifest": os.path.exists(os.path.join(p, "hasten_checkpoint.json")),
            "model_files": sorted(os.listdir(os.path.join(p, "model_0")))
            if os.path.isdir(os.path.join(p, "model_0"))
            else [],
        }
        for p in partial
    ]
    acc, model, opt = setup(True, project_config=ProjectConfiguration(project_dir=project, async_save=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = acc.load_state()
    res["passed_over"] = [str(w.message) for w in caught if "passed over" in str(w.message)]
    res["loaded"] = os.path.basename(info)
    saved = torch.load(os.path.join(out, f"kill_at_save_rank{rank}.pt"))
    now = full_weights(acc, model)
    res["loaded_is_saved"] = all(torch.equal(now[k], saved[k]) for k in saved)
    acc.save_state()
    acc.wait_for_checkpoint()
    res["left"] = sorted(e for e in os.listdir(root) if e != ".hasten-lock")
    acc.end_training()


if attempt == 0:
    check("main", fsdp_and_ddp)
    check("auto_naming", automatic_naming)
    kill_in_background_write()
else:
    check("resume", resume_after_kill)
    write_results()
