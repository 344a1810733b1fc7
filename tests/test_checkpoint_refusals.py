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

import pytest
import torch
from test_checkpoint import Counter, make, snapshot, train_steps

import hasten.rng


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
    monkeypatch.setattr(hasten.rng, "_numpy", lambda: None)  # as if NumPy were not installed here
    _refused(saved, "holds a NumPy state but NumPy is not installed")


def test_saved_without_gpu_loaded_where_one_is_seen_changes_nothing(saved, monkeypatch):
    monkeypatch.setattr(hasten.rng, "_cuda_device_count", lambda: 1)  # as if this process saw one GPU
    _refused(saved, r"states for 0 CUDA device\(s\) but this process sees 1")


def test_a_damaged_rng_state_changes_nothing(saved):
    rank = torch.load(os.path.join(saved, "rank_0.pt"), weights_only=True)
    rank["rng"]["torch"] = rank["rng"]["torch"][:100]
    _rewrite(saved, "rank_0.pt", rank)
    _refused(saved, "cannot restore RNG states")


def test_a_bad_data_position_changes_nothing(saved):
    rank = torch.load(os.path.join(saved, "rank_0.pt"), weights_only=True)
    rank["dataloaders"][0]["batches_yielded"] = -3
    _rewrite(saved, "rank_0.pt", rank)
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
    os.replace(os.path.join(saved, "model_0.safetensors"), outside)
    manifest["models"][0]["file"] = "../elsewhere.safetensors"
    manifest["files"]["../elsewhere.safetensors"] = manifest["files"].pop("model_0.safetensors")
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "lies outside the checkpoint folder")


def test_a_model_file_the_files_table_does_not_list_is_refused(saved):
    manifest_path = os.path.join(saved, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    del manifest["files"]["model_0.safetensors"]  # so its checksum would never be verified
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "does not list")


def test_a_pickled_object_in_a_model_file_is_named(tmp_path):
    objs = make()
    train_steps(*objs, 2)
    path = objs[0].save_state(tmp_path / "ckpt", safe_serialization=False)

    weights = torch.load(os.path.join(path, "model_0.bin"), weights_only=True)
    weights["extra"] = argparse.Namespace(payload="not a tensor")
    _rewrite(path, "model_0.bin", weights)
    _refused(path, r"(?s)cannot read the model weights .*model_0\.bin.*not a plain torch tensor file.*nothing was loaded")


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
        (root / entry / "model_0.safetensors").write_bytes(b"half")
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
