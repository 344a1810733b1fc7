"""A refused load_state changes nothing, whatever the reason (issue 16, items 1 and 4).

Each test saves a checkpoint, then loads it into fresh objects that have trained a step of
their own, and compares every state (weights, optimizer, scheduler, scaler, counters,
dataloader position, registered objects, RNG) before and after the refused load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import hasten.training.rng
from launch_utils import launch_env
from test_checkpoint import Counter, make, snapshot, train_steps


def _rng() -> tuple:
    return random.getstate(), torch.get_rng_state().clone()


def _refused(path, match, **load_kwargs):
    objs = make()
    train_steps(*objs, 1)
    before, rng = snapshot(*objs), _rng()
    with pytest.raises(ValueError, match=match):
        objs[0].load_state(path, **load_kwargs)
    after = snapshot(*objs)
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    for key in ("adam_step", "lr", "scale", "step", "real_steps", "counter", "loader"):
        assert before[key] == after[key], key
    assert _rng()[0] == rng[0] and torch.equal(_rng()[1], rng[1])
    return objs


@pytest.fixture
def saved(tmp_path):
    objs = make()
    train_steps(*objs, 3)
    return objs[0].save_state(tmp_path / "ckpt")


def _rewrite(directory: str, name: str, obj) -> None:
    """Replace a checkpoint file and its manifest entry (size, SHA-256), as a tool would."""
    path = os.path.join(directory, name)
    torch.save(obj, path)
    manifest_path = os.path.join(directory, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        data = f.read()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_numpy_state_where_numpy_is_missing_changes_nothing(saved, monkeypatch):
    monkeypatch.setattr(hasten.training.rng, "_numpy", lambda: None)  # as if NumPy were not installed here
    _refused(saved, "holds a NumPy state but NumPy is not installed")


def test_saved_without_gpu_loaded_where_one_is_seen_changes_nothing(saved, monkeypatch):
    monkeypatch.setattr(hasten.training.rng, "_cuda_device_count", lambda: 1)  # as if this process saw one GPU
    _refused(saved, r"states for 0 CUDA device\(s\) but this process sees 1")


def test_a_damaged_rng_state_changes_nothing(saved):
    rank = torch.load(os.path.join(saved, "random_states_0.pkl"), weights_only=False)
    rank["torch_manual_seed"] = rank["torch_manual_seed"][:100]
    _rewrite(saved, "random_states_0.pkl", rank)
    _refused(saved, "cannot restore RNG states")


def test_a_bad_data_position_changes_nothing(saved):
    rank = torch.load(os.path.join(saved, "random_states_0.pkl"), weights_only=False)
    rank["hasten"]["dataloaders"][0]["batches_yielded"] = -3
    _rewrite(saved, "random_states_0.pkl", rank)
    _refused(saved, "'batches_yielded' must be an integer >= 0")


def test_a_registered_object_that_refuses_its_state_changes_nothing(saved):
    class Picky(Counter):
        def load_state_dict(self, state):
            raise KeyError("not my state")

    objs = make()
    train_steps(*objs, 1)
    picky = Picky(5)
    objs[0].registry.custom_objects[0] = picky  # registered in place of the checkpoint's Counter
    before = snapshot(*objs)
    with pytest.raises(ValueError, match=r"registered object 0 \(Picky\) refused its state"):
        objs[0].load_state(saved)
    assert picky.value == 5
    after = snapshot(*objs)
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    assert before["adam_step"] == after["adam_step"] and before["lr"] == after["lr"]


def test_a_manifest_path_outside_the_folder_is_refused(saved, tmp_path):
    manifest_path = os.path.join(saved, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(os.path.join(saved, "model.safetensors"), outside)
    manifest["models"][0]["file"] = "../elsewhere.safetensors"
    manifest["files"]["../elsewhere.safetensors"] = manifest["files"].pop("model.safetensors")
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "lies outside the checkpoint folder")


def test_a_model_file_the_files_table_does_not_list_is_refused(saved):
    manifest_path = os.path.join(saved, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    del manifest["files"]["model.safetensors"]  # so its checksum would never be verified
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "does not list")


def test_a_pickled_object_in_a_model_file_is_named(tmp_path):
    objs = make()
    train_steps(*objs, 2)
    path = objs[0].save_state(tmp_path / "ckpt", safe_serialization=False)

    weights = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    weights["extra"] = argparse.Namespace(payload="not a tensor")
    _rewrite(path, "pytorch_model.bin", weights)
    _refused(
        path,
        r"(?s)cannot read the model weights .*pytorch_model\.bin.*not a plain torch tensor file.*nothing was loaded",
    )


# ---------------------------------------------------------------------- leftovers (issue 16, item 3)


def test_rotation_leaves_folders_it_did_not_write_and_says_so(tmp_path):
    objs = make(project_dir=tmp_path)
    root = tmp_path / "checkpoints"
    (root / "checkpoint_007").mkdir(parents=True)  # not hasten's (no manifest)
    (root / "checkpoint_007" / "notes.txt").write_text("mine")
    for _ in range(3):
        train_steps(*objs, 1)
        with pytest.warns(UserWarning, match="leaves 'checkpoint_007'.*not written by hasten"):
            objs[0].save_state(total_limit=1)
    names = sorted(e for e in os.listdir(root) if not e.startswith("."))
    assert names == ["checkpoint_007", "checkpoint_10"]  # numbering continued after 7; 8 and 9 rotated out
    assert (root / "checkpoint_007" / "notes.txt").read_text() == "mine"
    assert objs[0].load_state().endswith("checkpoint_10")  # the newest complete one, not the stray folder


def test_leftovers_of_interrupted_saves_are_removed_at_the_next_save(tmp_path):
    objs = make(project_dir=tmp_path)
    train_steps(*objs, 1)
    objs[0].save_state()
    root = tmp_path / "checkpoints"
    for entry in (".checkpoint_0.old-0123456789ab", ".checkpoint_5.del-abcdef012345", ".checkpoint_1.tmp-a1b2c3d4e5f6"):
        (root / entry).mkdir()
        (root / entry / "model.safetensors").write_bytes(b"half")
    (root / ".notes").mkdir()  # not hasten's pattern: kept
    train_steps(*objs, 1)
    objs[0].save_state()
    assert sorted(os.listdir(root)) == [".hasten-lock", ".notes", "checkpoint_0", "checkpoint_1"]


def test_a_newest_folder_without_manifest_is_passed_over_by_load_state(tmp_path):
    objs = make(project_dir=tmp_path)
    train_steps(*objs, 2)
    saved = objs[0].save_state()
    (tmp_path / "checkpoints" / "checkpoint_9").mkdir()  # e.g. copied by hand, half-written
    fresh = make(project_dir=tmp_path)
    assert fresh[0].load_state() == saved


# ---------------------------------------------------------------------- issue 29, item 4


def _hidden(parent, name):
    return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}."))


def _as_left_between_renames(parent, old_complete=True, new_complete=True):
    """Two real saves of ``ck`` (the second into ``ck2``), then the folders renamed as a crash between
    the two renames of the re-save leaves them: ``ck`` gone, ``.ck.old-*`` and ``.ck.tmp-*``."""
    objs = make()
    train_steps(*objs, 2)
    objs[0].save_state(parent / "ck")
    first = snapshot(*objs)["weights"]
    train_steps(*objs, 2)
    objs[0].save_state(parent / "ck2")
    second = snapshot(*objs)["weights"]
    os.rename(parent / "ck", parent / ".ck.old-0123456789ab")
    os.rename(parent / "ck2", parent / ".ck.tmp-ba9876543210")
    if not old_complete:
        os.remove(parent / ".ck.old-0123456789ab" / "hasten_checkpoint.json")
    if not new_complete:  # the manifest is written last: a tmp folder without one was still being written
        os.remove(parent / ".ck.tmp-ba9876543210" / "hasten_checkpoint.json")
    return first, second


def _loaded_weights(path, **kwargs):
    objs = make()
    objs[0].load_state(path, **kwargs)
    return snapshot(*objs)["weights"]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_crash_between_the_renames_of_a_re_save_loses_neither_copy(tmp_path):
    # The new copy is complete (its manifest is written before the renames): load_state("ck") puts it back.
    first, second = _as_left_between_renames(tmp_path)
    with pytest.warns(
        UserWarning, match=r"'ck' in .* was missing.*put back the complete copy '\.ck\.tmp-ba9876543210'"
    ):
        loaded = _loaded_weights(tmp_path / "ck")
    assert _same(loaded, second) and not _same(loaded, first)
    assert _hidden(tmp_path, "ck") == [".ck.old-0123456789ab"]  # the older copy stays until the next save
    objs = make()
    objs[0].save_state(tmp_path / "ck")  # which cleans it
    assert _hidden(tmp_path, "ck") == [] and os.path.isdir(tmp_path / "ck")


def test_a_crash_before_the_new_copy_was_complete_recovers_the_old_one(tmp_path):
    first, _ = _as_left_between_renames(tmp_path, new_complete=False)
    with pytest.warns(UserWarning, match=r"put back the complete copy '\.ck\.old-0123456789ab'"):
        assert _same(_loaded_weights(tmp_path / "ck"), first)


def test_the_next_save_recovers_before_it_cleans(tmp_path):
    first, _ = _as_left_between_renames(tmp_path, new_complete=False)
    objs = make()
    train_steps(*objs, 5)
    real_rename = os.rename
    seen = []

    def rename_and_look(src, dst):  # what is at 'ck' when the new save puts its copy in place
        seen.append(
            (
                os.path.basename(src),
                os.path.basename(dst),
                os.path.isfile(os.path.join(tmp_path, "ck", "hasten_checkpoint.json")),
            )
        )
        real_rename(src, dst)

    os.rename = rename_and_look
    try:
        with pytest.warns(
            UserWarning, match=r"save_state: 'ck' .* put back the complete copy '\.ck\.old-0123456789ab'"
        ):
            objs[0].save_state(tmp_path / "ck")
    finally:
        os.rename = real_rename
    assert seen[0] == (".ck.old-0123456789ab", "ck", False)  # recovered first, then replaced as a normal re-save
    assert _hidden(tmp_path, "ck") == []


def test_a_crash_that_left_no_complete_copy_is_named(tmp_path):
    _as_left_between_renames(tmp_path, old_complete=False, new_complete=False)
    with pytest.raises(
        FileNotFoundError,
        match=r"no checkpoint directory at .*/ck'; what an interrupted save of it left "
        r"\('\.ck\.old-0123456789ab', '\.ck\.tmp-ba9876543210'\) is incomplete",
    ):
        make()[0].load_state(tmp_path / "ck")
    assert _hidden(tmp_path, "ck") == [".ck.old-0123456789ab", ".ck.tmp-ba9876543210"]  # a refusal changes nothing


def test_a_kill_between_the_renames_of_a_re_save_is_recovered(tmp_path):
    """A real SIGKILL right after the first rename (the old copy moved aside), in a separate process."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_checkpoint import make, snapshot, train_steps
        objs = make()
        train_steps(*objs, 1)
        objs[0].save_state({str(tmp_path / "ck")!r})
        train_steps(*objs, 2)
        torch.save(snapshot(*objs)["weights"], {str(tmp_path / "second.pt")!r})
        real = os.rename
        def rename_then_die(src, dst):
            real(src, dst)
            if ".ck.old-" in os.path.basename(dst):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename_then_die
        objs[0].save_state({str(tmp_path / "ck")!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    hidden = _hidden(tmp_path, "ck")
    assert not os.path.exists(tmp_path / "ck") and [h.split("-")[0] for h in hidden] == [".ck.old", ".ck.tmp"]
    with pytest.warns(UserWarning, match=rf"put back the complete copy '{re.escape(hidden[1])}'"):
        loaded = _loaded_weights(tmp_path / "ck")
    assert _same(loaded, torch.load(tmp_path / "second.pt"))


def test_load_state_names_what_it_passes_over_in_one_line(tmp_path):
    objs = make(project_dir=tmp_path)
    train_steps(*objs, 2)
    saved = objs[0].save_state()
    root = tmp_path / "checkpoints"
    (root / "checkpoint_3").mkdir()  # a folder without manifest
    (root / ".checkpoint_2.tmp-0123456789ab").mkdir()  # a save killed while writing
    (root / ".checkpoint_2.tmp-0123456789ab" / "model.safetensors").write_bytes(b"half")
    fresh = make(project_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh[0].load_state() == saved
    lines = [str(w.message) for w in caught if "passed over" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "'checkpoint_3' (no hasten_checkpoint.json)" in lines[0]
    assert "'.checkpoint_2.tmp-0123456789ab' (a save of 'checkpoint_2' that did not finish)" in lines[0]
    assert "loading 'checkpoint_0', the newest complete checkpoint" in lines[0]


def test_a_torch_checkpoint_exception_on_load_is_a_checkpoint_error_naming_the_folder(tmp_path):
    """DCP's CheckpointException is a BaseException; load_state raises hasten's CheckpointError (an Exception)."""
    from hasten import Accelerator, FullyShardedDataParallelPlugin
    from hasten.checkpoint import CheckpointError

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    directory = acc.save_state(tmp_path / "ck")
    before = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    # Damage the first item of a shard in place (same size), past what verify_checksums=False checks
    # (a damaged .metadata is hasten's own DamagedCheckpoint: test_checkpoint_trust.py).
    meta = os.path.join(directory, "model_0", "__0_0.distcp")
    data = bytearray(open(meta, "rb").read())
    data[0] ^= 0xFF
    with open(meta, "wb") as f:
        f.write(data)
    with pytest.raises(
        CheckpointError,
        match=rf"load_state: cannot read the checkpoint '{re.escape(directory)}': "
        r"torch.distributed.checkpoint failed on rank 0: \w+.*Nothing was restored",
    ) as caught:
        acc.load_state(directory, verify_checksums=False)
    assert isinstance(caught.value, Exception) and "Traceback" not in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in acc.get_state_dict(model).items())
