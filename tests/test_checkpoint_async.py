"""Asynchronous save_state (issue 27): the loop waits only for the copy of what it changes next
(its next optimizer step does), the files are written in a background thread, and the
checkpoint stays atomic and verified.

One launch of 2 gloo processes (tests/scripts/checkpoint_async.py, under ``--max_restarts 1``)
runs the FSDP2 and DDP checks and a SIGKILL of the main process inside a background write;
a launch of 3 processes and this process (1) load the FSDP2 checkpoint at other sizes. The
rest runs here, on one process.
"""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint import CheckpointError, background, checksums
from hasten.checkpoint import files as ckpt_files
from hasten.checkpoint.merge import _merged_dcp
from hasten.utils import ProjectConfiguration
from launch_utils import SCRIPTS, launch, launch_env

SCRIPT = SCRIPTS / "checkpoint_async.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    proc = launch(
        "--num_processes",
        "2",
        "--cpu",
        "--max_restarts",
        "1",
        SCRIPT,
        out,
        "checks",
        env=launch_env(TMPDIR=str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    attempts = {}
    for a in (0, 1):
        attempts[a] = [json.loads((out / f"attempt{a}_rank{r}.json").read_text()) for r in (0, 1)]
    return out, attempts


def _ok(rec):
    assert not (isinstance(rec, dict) and "error" in rec and "tb" in rec), rec
    return rec


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_async_save_returns_before_the_copy_and_the_write_and_training_goes_on(launched, kind):
    """save_state returns before the parameters and optimizer state are copied; the next step
    waits for that copy, and the checkpoint (loaded back) holds the state at save_state,
    buffers too, which changed in the next forward (test_async_files_hold_what_a_synchronous_save_holds
    compares it with a synchronous save)."""
    _, attempts = launched
    for rec in attempts[0]:
        assert rec["main"] is None, rec["main"]
        r = rec[kind]
        assert r["target_existed_on_return"] is False  # not renamed yet: the thread was still writing
        assert r["copied_on_return"] is False  # the weights and optimizer state are copied in the thread,
        assert r["copied_before_end_of_step"]  # and the next optimizer step waited for that copy
        assert r["exists_after_wait"]
        if rec["rank"] == 0:  # the full weights are gathered to the main process
            assert r["buffer_changed"]  # a buffer changed in the next forward, before the copy was made
            assert r["trained_while_writing"]
            assert r["loaded_is_at_save"]  # the checkpoint holds the state at save_state, not the later one


def _load_all(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_async_files_hold_what_a_synchronous_save_holds(launched):
    from safetensors.torch import load_file

    out, _ = launched
    for kind in ("fsdp", "ddp"):
        sync, asyn = out / f"sync_{kind}", out / f"async_{kind}"
        ms, ma = (json.loads((p / "hasten_checkpoint.json").read_text()) for p in (sync, asyn))
        assert set(ms["files"]) == set(ma["files"]) and ms["models"] == ma["models"]
        for name in ms["files"]:
            if name.endswith(".pt"):
                assert _same(_load_all(sync / name), _load_all(asyn / name)), name
            elif name.endswith(".safetensors"):
                assert _same(load_file(sync / name), load_file(asyn / name)), name
        if kind == "fsdp":
            for folder in ("model_0", "optimizer_0"):
                assert _same(_merged_dcp(str(sync / folder)), _merged_dcp(str(asyn / folder))), folder
            at_save = torch.load(out / "weights_at_save_fsdp.pt")
            assert _same(at_save, _merged_dcp(str(asyn / "model_0")))


def test_the_manifest_lists_what_each_process_hashed_as_it_wrote(launched):
    out, _ = launched
    for kind in ("fsdp", "ddp"):
        path = out / f"async_{kind}"
        manifest = json.loads((path / "hasten_checkpoint.json").read_text())
        on_disk = sorted(
            str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "hasten_checkpoint.json"
        )
        assert sorted(manifest["files"]) == on_disk
        for name, rec in manifest["files"].items():
            if (
                "/" in name
            ):  # DCP's files: the XXH3-128 of each item (.metadata: one), every byte in one part, hashed once
                parts = rec["parts"]
                assert "xxh3_128" not in rec and rec["size"] == (path / name).stat().st_size, name
                assert [o for o, _, _ in parts] == [0] + [o + n for o, n, _ in parts[:-1]], name
                assert sum(n for _, n, _ in parts) == rec["size"], name
                assert checksums.verify_file(str(path / name), rec) is None, name
            else:  # size and XXH3-128 of the file as it is
                assert rec == checksums.record(str(path / name)), name
    fsdp = json.loads((out / "async_fsdp" / "hasten_checkpoint.json").read_text())["files"]
    assert {"model_0/__0_0.distcp", "model_0/__1_0.distcp", "model_0/.metadata"} <= set(fsdp)  # both processes' shards


def test_a_second_save_waits_for_the_first(launched):
    _, attempts = launched
    for rec in attempts[0]:
        row = rec["row"]
        assert row["a_before"] is False and row["a_when_b_returned"] is True  # b waited for a to be complete
        assert row["b_when_b_returned"] is False and row["b_after_wait"] is True


def test_automatic_naming_and_total_limit_with_async_saves(launched):
    _, attempts = launched
    for rec in attempts[0]:
        assert rec["auto_naming"] is None, rec["auto_naming"]
        assert rec["auto"] == ["checkpoint_1", "checkpoint_2"]


def test_a_damaged_shard_is_refused_by_name_on_every_process_and_nothing_loads(launched):
    _, attempts = launched
    for rec in attempts[0]:
        d = rec["damaged"]
        assert d["error"] is not None and d["error"].startswith("DamagedCheckpoint: "), d
        assert re.search(r"'model_0/__1_0.distcp' bytes \d+-\d+ do not match their checksum", d["error"]), d["error"]
        assert d["unchanged"]
    assert attempts[0][0]["damaged"]["error"] == attempts[0][1]["damaged"]["error"]  # the same words on both


def test_sigkill_inside_the_background_write_keeps_the_last_checkpoint(launched):
    _, attempts = launched
    for rec in attempts[0]:
        assert "not_killed" not in rec
    for rec in attempts[1]:
        assert rec["resume"] is None, rec["resume"]
        partial = [e for e in rec["found"] if e.startswith(".checkpoint_1.tmp-")]
        assert len(partial) == 1 and [e for e in rec["found"] if e not in partial] == ["checkpoint_0"]
        assert rec["partial"] == [{"manifest": False, "model_files": rec["partial"][0]["model_files"]}]
        assert rec["partial"][0]["model_files"]  # killed mid-checkpoint: the model written, no manifest
        assert rec["loaded"] == "checkpoint_0" and rec["loaded_is_saved"]
        if rec["rank"] == 0:
            assert len(rec["passed_over"]) == 1 and partial[0] in rec["passed_over"][0]
        assert rec["left"] == ["checkpoint_0", "checkpoint_1"]  # the next save cleaned the partial one


def _fsdp_model():
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from fsdp_common import counting_forwards, make_model

    return counting_forwards(make_model(seed=3))


def test_async_checkpoint_loads_at_one_and_three_processes(launched):
    out, _ = launched
    at_save = torch.load(out / "weights_at_save_fsdp.pt")
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    acc.load_state(out / "async_fsdp")
    assert _same(at_save, {k: v.detach().clone() for k, v in model.state_dict().items()})
    proc = launch("--num_processes", "3", "--cpu", SCRIPT, out, "load", env=launch_env(TMPDIR=str(out)), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _same(at_save, torch.load(out / "loaded_3.pt"))


# ---------------------------------------------------------------------- one process


def _one(tmp_path, **config):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path), **config))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return acc, model, opt


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_async_save_values_are_refused_where_written(tmp_path, value):
    with pytest.raises(TypeError, match=r"ProjectConfiguration.async_save must be True or False, got"):
        ProjectConfiguration(async_save=value)
    acc, _, _ = _one(tmp_path)
    if value is not None:
        with pytest.raises(TypeError, match=r"save_state.async_save must be True, False or None, got"):
            acc.save_state(str(tmp_path / "ck"), async_save=value)
        assert not (tmp_path / "ck").exists() and acc.project_configuration.iteration == 0


def test_a_background_failure_is_raised_by_wait_for_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    acc, _, _ = _one(tmp_path)
    acc.save_state(str(tmp_path / "good"))

    def disk_full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(tmp, "model.safetensors"))

    monkeypatch.setattr(background, "before_write", disk_full)
    acc.save_state(str(tmp_path / "good"), async_save=True)  # a re-save of the same folder
    with pytest.raises(
        CheckpointError, match=r"asynchronous save_state of .*good' failed: .*No space left on device \[ENOSPC\]"
    ):
        acc.wait_for_checkpoint()
    acc.wait_for_checkpoint()  # raised once
    assert sorted(os.listdir(tmp_path)) == ["good"]  # the previous copy kept, the partial one removed
    monkeypatch.setattr(background, "before_write", None)
    acc.load_state(str(tmp_path / "good"))


def test_a_failed_copy_fails_the_save_and_the_next_step_does_not_wait_for_it(tmp_path, monkeypatch):
    acc, model, opt = _one(tmp_path)
    copies_in_flight = acc._checkpointer.barrier.events  # what the next optimizer step waits for
    acc.save_state(str(tmp_path / "good"))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def no_memory():
        raise MemoryError("cannot allocate the host copy")

    monkeypatch.setattr(background, "before_stage", no_memory)
    acc.save_state(str(tmp_path / "good"), async_save=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # returns: the copy failed, so there is nothing to wait for
    assert not copies_in_flight
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(
        CheckpointError, match=r"asynchronous save_state of .*good' failed: MemoryError: cannot allocate the host copy"
    ):
        acc.wait_for_checkpoint()
    assert sorted(os.listdir(tmp_path)) == ["good"]  # the previous copy kept, the partial one removed
    monkeypatch.setattr(background, "before_stage", None)
    acc.load_state(str(tmp_path / "good"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_hastens_own_writes_into_the_weights_wait_for_the_copy(tmp_path, monkeypatch):
    """load_model and LocalSGD's averaging change parameters in place: they wait, as a step does."""
    import threading

    from hasten.training.local_sgd import LocalSGD

    acc, model, opt = _one(tmp_path)
    copies_in_flight = acc._checkpointer.barrier.events  # what the next optimizer step waits for
    acc.save_model(model, str(tmp_path / "weights"))
    gate = threading.Event()
    for wait_here in (lambda: acc.load_model(model, str(tmp_path / "weights")),
                      lambda: LocalSGD(acc, model, local_sgd_steps=1)._sync_and_avg_model_params()):  # fmt: skip
        gate.clear()
        monkeypatch.setattr(background, "before_stage", gate.wait)
        acc.save_state(str(tmp_path / "ck"), async_save=True)
        assert copies_in_flight and not copies_in_flight[0].is_set()
        threading.Timer(0.2, gate.set).start()
        wait_here()
        assert not copies_in_flight and gate.is_set()
        acc.wait_for_checkpoint()


def test_async_save_by_default_from_the_configuration_and_end_training_waits(tmp_path, monkeypatch):
    import time

    acc, model, _ = _one(tmp_path, async_save=True)
    monkeypatch.setattr(background, "before_write", lambda tmp: time.sleep(0.2))
    acc.save_state()
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()
    acc.end_training()
    assert (tmp_path / "checkpoints" / "checkpoint_0" / "hasten_checkpoint.json").is_file()


_EXIT_SCRIPT = """
import sys, time, torch
from hasten import Accelerator
from hasten.checkpoint import background
acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 3)
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
background.before_write = lambda tmp: time.sleep(0.5)
acc.save_state(sys.argv[1], async_save=True)
print("returned", flush=True)
"""


def test_the_interpreter_exit_waits_for_the_background_write(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(target)], env=launch_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "returned", proc.stderr
    assert (target / "hasten_checkpoint.json").is_file()  # the script's end waited for the thread


def test_each_item_is_verified_as_it_is_read_and_only_what_is_read(tmp_path):
    """DCP's files list the XXH3-128 of each item; a process verifies the bytes of each item it
    reads as it reads them (one pass), so a damaged item another process reads is not its concern
    (FSDP2's replicated step counters are saved in one process's file and read by all), and a
    damaged item it reads is refused by name with nothing loaded."""
    from torch.distributed.checkpoint import FileSystemReader

    from hasten.checkpoint.checksums import hasher
    from hasten.checkpoint.errors import DamagedCheckpoint
    from hasten.checkpoint.layouts.dcp import _load

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(2, 256)).sum())
    opt.step()
    ck = tmp_path / "ck"
    acc.save_state(str(ck))
    manifest = json.loads((ck / "hasten_checkpoint.json").read_text())
    storage = FileSystemReader(str(ck / "model_0")).read_metadata().storage_data
    where = {idx.fqn: info for idx, info in storage.items()}
    bias = where["1.bias"]
    name = f"model_0/{bias.relative_path}"
    path = ck / name
    data = path.read_bytes()
    for offset, length, digest in manifest["files"][name]["parts"]:  # each part: the XXH3-128 of those bytes
        h = hasher()
        h.update(data[offset : offset + length])
        assert h.hexdigest() == digest
    damaged = bytearray(data)
    damaged[bias.offset + bias.length - 1] ^= 1  # the last byte of 1.bias's item
    path.write_bytes(bytes(damaged))

    def target(*keys):
        return {k: torch.empty_like(v) for k, v in model.state_dict().items() if k in keys}

    first = target("0.weight")
    _load(first, str(ck), "model_0", manifest, "the checkpoint", verify=True)  # reads no byte of 1.bias
    assert torch.equal(_full(first["0.weight"]), _full(model.state_dict()["0.weight"]))
    with pytest.raises(
        DamagedCheckpoint,
        match=rf"'{name}' bytes {bias.offset}-{bias.offset + bias.length} do not match their checksum",
    ):
        _load(target("1.bias"), str(ck), "model_0", manifest, "the checkpoint", verify=True)
    _load(target("1.bias"), str(ck), "model_0", manifest, "the checkpoint", verify=False)  # unverified, it reads
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    moved = {k: _full(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(DamagedCheckpoint, match=rf"'{name}' bytes .* do not match their checksum"):
        acc.load_state(str(ck))
    assert all(torch.equal(_full(v), moved[k]) for k, v in model.state_dict().items())  # nothing loaded


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_each_accelerator_has_save_plans_of_its_own_and_end_training_drops_them(tmp_path):
    """torch caches save plans in class-wide dicts under the planner's key; keyed by id() a new
    Accelerator could find a dead one's plans (ids are reused), so the key is a token of its own."""
    from torch.distributed.checkpoint.planner import SavePlanner

    def cached(acc):
        prefix = f"{acc._checkpointer.plans_key}:"
        return {k for k in SavePlanner._cached_save_plan if k.startswith(prefix)}

    accs = []
    for i in range(2):
        acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
        model = torch.nn.Linear(4, 4)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.save_state(str(tmp_path / f"ck{i}"))
        accs.append(acc)
    assert accs[0]._checkpointer.plans_key != accs[1]._checkpointer.plans_key
    assert cached(accs[0]) and cached(accs[1])
    accs[0].end_training()
    assert not cached(accs[0]) and cached(accs[1])


@pytest.mark.parametrize("async_save", [False, True])
def test_every_sharded_file_is_fsynced_once_all_are_written_and_before_the_manifest(tmp_path, monkeypatch, async_save):
    """DCP's files are written unsynced and fsynced together at the end (the disk writes the
    model's back while the optimizer's is written); none may be missed, and all come before the
    manifest, so a checkpoint with a manifest is on the disk whole."""
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Linear(4, 3)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", os.path.realpath(os.fspath(dst))))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    target = tmp_path / "ck"
    acc.save_state(str(target), async_save=async_save)
    acc.wait_for_checkpoint()
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(os, "rename", real_rename)
    fsynced = [p for kind, p in events if kind == "fsync"]
    manifest = next(i for i, p in enumerate(fsynced) if os.path.basename(p) == "hasten_checkpoint.json")
    tmp = os.path.dirname(fsynced[manifest])  # the files are fsynced in the temporary folder, renamed after
    assert ("rename", os.path.realpath(target)) in events[events.index(("fsync", fsynced[manifest])) :]
    before = {os.path.relpath(p, tmp) for p in fsynced[:manifest]}
    sharded = []
    for folder in ("model_0", "optimizer_0"):
        names = os.listdir(target / folder)
        assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
        sharded += [f"{folder}/{n}" for n in names] + [folder]
    missing = [p for p in sharded if p not in before]
    assert not missing, f"not fsynced before the manifest: {missing}; fsynced: {sorted(before)}"
    acc.load_state(str(target))


def test_a_parts_record_verifies_the_whole_file_part_by_part_and_earlier_records_still_verify(tmp_path):
    """DCP's files are recorded as parts that tile the file (each byte hashed once, as written);
    a file is verified whole by its parts, and records of earlier versions (a whole-file
    XXH3-128 beside the parts, or SHA-256) verify as before."""
    import hashlib

    from hasten.checkpoint.checksums import hasher, part_table, verify_file
    from hasten.checkpoint.files import naming_os_errors

    path = str(tmp_path / "f.distcp")
    items = [b"a" * 10, b"bc" * 700, b"", b"d" * 3]
    with open(path, "wb") as raw, naming_os_errors(raw, path, parts=True) as f:
        for item in items:  # as DCP's writer: tell() before and after each item
            f.tell()
            f.write(item)
            f.tell()
        f.write(b"tail")  # bytes after the last tell() are a part of their own
    rec = f.record()
    data = open(path, "rb").read()
    assert "xxh3_128" not in rec and rec["size"] == len(data) == 10 + 1400 + 3 + 4
    assert [(o, n) for o, n, _ in rec["parts"]] == [(0, 10), (10, 1400), (1410, 3), (1413, 4)]
    assert part_table(rec) is not None and verify_file(path, rec) is None

    damaged = bytearray(data)
    damaged[500] ^= 1
    open(path, "wb").write(bytes(damaged))
    assert verify_file(path, rec) == "bytes 10-1410 do not match their checksum"
    open(path, "wb").write(data)
    assert verify_file(path, {**rec, "parts": rec["parts"][1:]}) == "has a malformed list of parts"  # not from byte 0
    assert part_table({**rec, "size": rec["size"] + 1}) is None  # not up to its size

    whole = hasher()
    whole.update(data)
    earlier = {**rec, "xxh3_128": whole.hexdigest()}  # as versions before this one wrote DCP's files
    assert verify_file(path, earlier) is None
    assert verify_file(path, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}) is None
    # the SHA-256 era listed a SHA-256 per small item: those parts are never taken for XXH3-128 ones
    sha_parts = [[o, n, hashlib.sha256(data[o : o + n]).hexdigest()] for o, n, _ in rec["parts"]]
    sha_era = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": sha_parts}
    assert part_table(sha_era) is None and verify_file(path, sha_era) is None
    open(path, "wb").write(bytes(damaged))
    assert verify_file(path, earlier) == "does not match its checksum"
    assert (
        verify_file(path, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        == "does not match its checksum"
    )
    assert verify_file(path, sha_era) == "does not match its checksum"


def test_a_sharded_checkpoint_of_the_earlier_record_format_loads_verified(tmp_path):
    """Checkpoints written before DCP's files were hashed in parts only carry a whole-file
    XXH3-128 beside the parts: they load, each item verified, and a damaged one is refused."""
    from hasten.checkpoint.checksums import record
    from hasten.checkpoint.errors import DamagedCheckpoint

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Linear(8, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ck = tmp_path / "ck"
    acc.save_state(str(ck))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = ck / "hasten_checkpoint.json"
    manifest = json.loads(path.read_text())
    for name, rec in manifest["files"].items():
        if "/" in name:
            rec.update(record(str(ck / name)))  # the whole-file checksum as well, as earlier versions wrote
    path.write_text(json.dumps(manifest))
    with torch.no_grad():
        model.weight.add_(1.0)
    acc.load_state(str(ck))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    shard = ck / "model_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"'model_0/__0_0.distcp' bytes \d+-\d+ do not match their checksum"):
        acc.load_state(str(ck))


@pytest.mark.parametrize("fsdp", [True, False])
def test_large_files_are_sent_to_the_disk_as_they_are_written(tmp_path, monkeypatch, fsdp):
    """Every WRITE_BACK_BYTES written, the kernel is asked to start writing those bytes out
    (sync_file_range), so the fsync at the end waits only for the tail: each file's requests
    cover its bytes from 0 in order, and the checkpoint is whole (it loads, verified)."""
    import io as pyio

    calls: dict[str, list[tuple[int, int]]] = {}
    real = ckpt_files._write_back

    def write_back(fd, offset, length):
        calls.setdefault(os.readlink(f"/proc/self/fd/{fd}"), []).append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(ckpt_files, "_write_back", write_back)
    monkeypatch.setattr(ckpt_files, "WRITE_BACK_BYTES", 1 << 16)
    plugin = {"fsdp_plugin": FullyShardedDataParallelPlugin()} if fsdp else {}
    acc = Accelerator(cpu=True, **plugin)
    model = torch.nn.Linear(256, 256)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc.save_state(str(tmp_path / "ck"))
    big = {os.path.relpath(p, os.path.dirname(os.path.dirname(p))): c for p, c in calls.items()}
    assert len(big) == len(calls) and all(
        c[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(c, c[1:])) for c in big.values()
    ), big
    assert all(sum(n for _, n in c) >= 1 << 16 for c in big.values())
    expected = {"model_0/__0_0.distcp", "optimizer_0/__0_0.distcp"} if fsdp else {"model.safetensors", "optimizer.bin"}
    assert expected <= {
        n if "/" in n and n.split("/")[0] in ("model_0", "optimizer_0") else os.path.basename(n) for n in big
    }, big
    with torch.no_grad():
        model.weight.add_(1.0)
    acc.load_state(str(tmp_path / "ck"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    # a stream that is no file of the OS is written as before, without the hint
    with ckpt_files.naming_os_errors(pyio.BytesIO(), "mem") as f:
        f.write(b"x" * (1 << 17))
    assert f.record()["size"] == 1 << 17


def test_the_write_back_hint_is_left_out_while_the_kernel_writes_back_by_itself(monkeypatch):
    """Past half the kernel's background threshold of dirty memory its flusher writes back by
    itself, and a hint would only block the writer on a full disk queue: none is sent then."""
    sent = []
    monkeypatch.setattr(ckpt_files, "_sync_file_range", lambda: lambda *args: sent.append(args) or 0)
    monkeypatch.setattr(ckpt_files, "_background_threshold", lambda: (1 << 62, 0))  # far above what is dirty
    assert not ckpt_files._kernel_writes_back()
    ckpt_files._write_back(7, 0, 1 << 20)
    assert sent == [(7, 0, 1 << 20, 2)]  # SYNC_FILE_RANGE_WRITE
    monkeypatch.setattr(ckpt_files, "_background_threshold", lambda: (1, 0))  # 1 byte: the flusher is at work
    assert ckpt_files._kernel_writes_back()
    ckpt_files._write_back(7, 1 << 20, 1 << 20)
    assert len(sent) == 1
