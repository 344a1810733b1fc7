"""Checkpoint folders (issue 38): hasten follows no link it did not create, one writer per folder,
and a read-only copy of a finished run still loads."""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpoint import CheckpointError, locks, naming
from launch_utils import SCRIPTS, launch_env

HOST = socket.gethostname()
LINK_REFUSED = "is a symbolic link; hasten does not follow links it did not create: remove it"


def _automatic(project) -> ProjectConfiguration:
    return ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)


def _run(project=None) -> tuple[Accelerator, torch.nn.Module]:
    accelerator = Accelerator(cpu=True, project_config=_automatic(project) if project else None)
    return accelerator, accelerator.prepare(torch.nn.Linear(3, 3))


def _untouched(path) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        return f.read(), os.stat(path).st_mtime_ns


def _listing(folder) -> dict[str, list[str]]:
    return {os.path.relpath(d, folder): sorted(dirs + files) for d, dirs, files in os.walk(folder)}


# ---------------------------------------------------------------------- links (item 2)


def test_a_symlinked_folder_lock_is_refused_by_name_and_its_target_left_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    root = tmp_path / "project" / "checkpoints"
    root.mkdir(parents=True)
    (root / ".hasten-lock").symlink_to(victim)
    before = _untouched(victim)
    with pytest.raises(
        CheckpointError, match=rf"Accelerator: '\.hasten-lock' in '{re.escape(str(root))}' {LINK_REFUSED}"
    ):
        Accelerator(cpu=True, project_config=_automatic(tmp_path / "project"))
    assert _untouched(victim) == before and os.path.islink(root / ".hasten-lock")
    # A dangling link: nothing is created where it points.
    os.remove(root / ".hasten-lock")
    (root / ".hasten-lock").symlink_to(tmp_path / "created_through_the_link")
    with pytest.raises(CheckpointError, match=LINK_REFUSED):
        Accelerator(cpu=True, project_config=_automatic(tmp_path / "project"))
    assert not os.path.lexists(tmp_path / "created_through_the_link")


def test_a_symlinked_save_lock_or_output_dir_is_refused_and_nothing_behind_it_changes(tmp_path):
    accelerator, _ = _run()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    os.utime(victim, ns=(1_000_000_000, 1_000_000_000))
    (tmp_path / ".hasten-lock.ck").symlink_to(victim)
    before = _untouched(victim)
    with pytest.raises(CheckpointError, match=rf"'\.hasten-lock\.ck' in .* {LINK_REFUSED}"):
        accelerator.save_state(tmp_path / "ck")
    assert _untouched(victim) == before and sorted(os.listdir(tmp_path)) == [".hasten-lock.ck", "victim.txt"]
    # output_dir itself a link to a checkpoint elsewhere: refused, the link and its folder as they were.
    os.remove(tmp_path / ".hasten-lock.ck")
    real = tmp_path / "elsewhere"
    accelerator.save_state(real)
    (tmp_path / "ck").symlink_to(real)
    real_before = {n: _untouched(real / n) for n in os.listdir(real)}
    with pytest.raises(
        CheckpointError, match=r"save_state: 'ck' in .* is a symbolic link; hasten does not follow links"
    ):
        accelerator.save_state(tmp_path / "ck")
    assert os.path.islink(tmp_path / "ck") and {n: _untouched(real / n) for n in os.listdir(real)} == real_before
    assert sorted(os.listdir(tmp_path)) == ["ck", "elsewhere", "victim.txt"]  # no lock, no temporary folder left


def test_rotation_neither_deletes_nor_renames_a_symlinked_checkpoint(tmp_path):
    kept = tmp_path / "kept"
    _run()[0].save_state(kept)  # a real hasten checkpoint, elsewhere ...
    accelerator, _ = _run(tmp_path / "project")
    root = tmp_path / "project" / "checkpoints"
    (root / "checkpoint_0").symlink_to(kept)  # ... linked in as the oldest
    before = _listing(kept)
    for _ in range(2):
        with pytest.warns(UserWarning, match=r"total_limit leaves 'checkpoint_0' in .* alone: symbolic links"):
            accelerator.save_state(total_limit=1)
    assert os.path.islink(root / "checkpoint_0") and _listing(kept) == before
    assert sorted(os.listdir(root)) == [".hasten-lock", "checkpoint_0", "checkpoint_2"]


# ---------------------------------------------------------------------- one writer per folder (item 7)


def test_two_runs_saving_into_one_folder_never_break_each_others_saves(tmp_path):
    folder, go = tmp_path / "shared_ck", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "folders_concurrent.py"), str(folder), str(tmp_path / f"run{i}.json"),
             "30", str(go)],
            env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        time.sleep(0.5)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    runs = [json.loads((tmp_path / f"run{i}.json").read_text()) for i in range(2)]
    for me, other in ((runs[0], runs[1]), (runs[1], runs[0])):
        assert me["failed"] == []  # never ENOENT on its own temporary folder
        assert me["saved"] + len(me["refused"]) == 30
        who = f"'{folder}' is being written by another run (pid {other['pid']} on host {other['host']})"
        assert all(who in message for message in me["refused"]), me["refused"][:3]
    assert sum(len(r["refused"]) for r in runs) > 0  # the saves did meet (each lasts 20 ms or more)
    assert naming.is_complete(str(folder))
    assert sorted(os.listdir(tmp_path)) == ["go", "run0.json", "run1.json", "shared_ck"]  # no lock, no temporary left
    accelerator, model = _run()
    accelerator.load_state(folder)
    value = model.weight[0, 0].item()  # each save wrote pid % 1000 + its index: the folder holds one run's save whole
    assert any(0 <= value - r["pid"] % 1000 < 30 for r in runs) and bool((model.weight == value).all())


def _holder(*args: str) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "folders_holder.py"), *args],
        env=launch_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_save_is_left_alone_and_a_dead_ones_leftovers_are_cleaned(tmp_path):
    accelerator, _ = _run()
    holder = _holder("claim", str(tmp_path), "ck")
    try:
        live = tmp_path / ".ck.tmp-0123456789ab"
        who = rf"ck' is being written by another run \(pid {holder.pid} on host {re.escape(HOST)}\)"
        with pytest.raises(CheckpointError, match=who):
            accelerator.save_state(tmp_path / "ck")
        assert sorted(os.listdir(tmp_path)) == [".ck.tmp-0123456789ab", ".hasten-lock.ck"] and live.is_dir()
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    # The holder is dead: its temporary folder and lock file are what a crash leaves; the next save removes them.
    assert (tmp_path / ".hasten-lock.ck").read_text().split() == [str(holder.pid), HOST]
    accelerator.save_state(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"] and naming.is_complete(str(tmp_path / "ck"))


def test_a_save_into_another_runs_checkpoints_folder_is_refused(tmp_path):
    accelerator, _ = _run()
    holder = _holder("project", str(tmp_path / "project"))
    try:
        root = tmp_path / "project" / "checkpoints"
        with pytest.raises(
            CheckpointError, match=rf"checkpoints' is in use by another run \(pid {holder.pid} on host "
        ):
            accelerator.save_state(root / "mine")
        assert sorted(os.listdir(root)) == [".hasten-lock"]
    finally:
        holder.communicate(timeout=30)  # closes its stdin: it ends


# ---------------------------------------------------------------------- read-only project_dir (item 9)


def _finished_run(project) -> list[list[float]]:
    """Two checkpoints in ``project``, by a run that then ends (its Accelerator gone, the folder free)."""
    accelerator, model = _run(project)
    for value in (1.0, 2.0):
        with torch.no_grad():
            model.weight.fill_(value)
        accelerator.save_state()
    weights = model.weight.detach().tolist()
    del accelerator, model
    gc.collect()
    assert os.path.realpath(project / "checkpoints") not in locks._held
    return weights


def _read_only_mount_works(probe) -> str | None:
    """None if this machine can make a read-only bind mount in a mount namespace; else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare or mount"
    probe.mkdir()
    cmd = f"mount --bind {probe} {probe} && mount -o remount,bind,ro {probe} && ! touch {probe}/x 2>/dev/null"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    return (
        None if proc.returncode == 0 else f"unshare -m with a read-only bind mount failed: {proc.stderr.strip()[:200]}"
    )


def test_a_read_only_copy_of_a_finished_run_loads_and_refuses_to_save(tmp_path):
    """A real read-only folder: a read-only bind mount in a mount namespace of its own (chmod does
    not stop root, as the tests run)."""
    why = _read_only_mount_works(tmp_path / "probe")
    if why is not None:
        pytest.skip(why)
    project = tmp_path / "project"
    weights = _finished_run(project)
    before = _listing(project)
    out = tmp_path / "out.json"
    run = f'mount --bind {project} {project} && mount -o remount,bind,ro {project} && exec "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", run,
         sys.executable, str(SCRIPTS / "folders_read_only.py"), str(project), str(out)],
        env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    root = project / "checkpoints"
    assert record["loaded"] == str(root / "checkpoint_1") and record["weight"] == weights
    assert record["refused"] == (
        f"CheckpointError: save_state: cannot write in the checkpoint folder '{root}': Read-only file system [EROFS] "
        f"('{root / '.hasten-lock'}'); the checkpoints of a read-only folder can be loaded, not saved there. "
        "Nothing was written: give this run a writable folder"
    )
    assert _listing(project) == before


def test_an_unwritable_project_dir_simulated_loads_and_refuses_to_save(tmp_path, monkeypatch):
    """The same without a mount: os.open of anything in the folder for writing raises EROFS."""
    project = tmp_path / "project"
    weights = _finished_run(project)
    before = _listing(project)
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(project)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    accelerator, model = _run(project)
    assert accelerator.load_state() == str(project / "checkpoints" / "checkpoint_1")
    assert model.weight.detach().tolist() == weights
    refused = r"save_state: cannot write in the checkpoint folder .*Read-only file system \[EROFS\]"
    with pytest.raises(CheckpointError, match=refused):
        accelerator.save_state()
    assert _listing(project) == before
