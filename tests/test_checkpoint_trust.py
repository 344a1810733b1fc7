"""Nothing in a checkpoint is executed; damaged metadata and manifests are one-line refusals (issue 38).

Each crafted file pickles ``os.system("touch MARKER")`` (``trust_common.Payload``) inside a
structure the load would otherwise accept, and the manifest's checksums are recomputed, so
only hasten's allow-lists stand between the file and the command: every read path is checked
to refuse it by file and by what it asked for, to leave no marker and to change nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from trust_common import craft_item, craft_metadata, craft_torch_file, damage_metadata, edit_manifest

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint import load_model
from hasten.checkpoint.errors import DamagedCheckpoint, UnsafeCheckpoint
from hasten.checkpoint.merge import merge_weights
from hasten.cli import main
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks
from test_checkpoint import make, train_steps
from test_checkpoint_refusals import _refused

ASKED = (
    r"it asks to load 'posix\.system', which is not data a checkpoint holds \(hasten never runs code from a "
    r"checkpoint\)"
)


def _fsdp_objects():
    """A model and AdamW prepared with FSDP on one process (the "dcp" layout), after one step."""
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    acc.backward(model(torch.randn(2, 8)).sum())
    opt.step()
    return acc, model, opt


def _weights(acc, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def dcp_checkpoint(tmp_path):
    acc, model, opt = _fsdp_objects()
    path = acc.save_state(str(tmp_path / "good"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return acc, model, opt, path


def _copy(path, tmp_path, name: str) -> str:
    return shutil.copytree(path, str(tmp_path / name))


# ---------------------------------------------------------------------- code in a checkpoint (item 1)


def test_a_dcp_metadata_that_asks_to_run_code_is_refused_by_load_state_and_merge_weights(
    dcp_checkpoint, tmp_path, capsys
):
    acc, model, opt, good = dcp_checkpoint
    ck, marker = _copy(good, tmp_path, "ck"), tmp_path / "marker"
    craft_metadata(ck, marker)
    before = _weights(acc, model)
    for verify in (True, False):  # the metadata is allow-listed, verified or not
        with pytest.raises(UnsafeCheckpoint, match=rf"cannot read 'model_0/\.metadata': {ASKED}; nothing was loaded$"):
            acc.load_state(ck, verify_checksums=verify)
    assert _same(before, _weights(acc, model)) and opt.param_groups[0]["lr"] == 0.05
    with pytest.raises(UnsafeCheckpoint, match=rf"^merge-weights: the checkpoint .*'model_0/\.metadata': {ASKED}"):
        merge_weights(ck, tmp_path / "merged")
    assert main(["merge-weights", ck, str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'model_0/.metadata'" in err and "'posix.system'" in err, err
    assert not marker.exists() and not (tmp_path / "merged").exists()
    acc.load_state(good)  # the untouched checkpoint still loads


def test_a_dcp_item_that_asks_to_run_code_is_refused(dcp_checkpoint, tmp_path):
    """torch's planner reads non-tensor items (optimizer param_groups values) with weights_only=False."""
    acc, model, opt, good = dcp_checkpoint
    ck, marker = _copy(good, tmp_path, "ck"), tmp_path / "marker"
    shard = craft_item(ck, marker)
    before = _weights(acc, model)
    with pytest.raises(UnsafeCheckpoint, match=rf"cannot read the item 'param_groups\.0\.lr' of '{shard}': {ASKED}"):
        acc.load_state(ck)
    assert not marker.exists()
    assert _same(before, _weights(acc, model)) and opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize(
    "name", ["pytorch_model.bin", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"]
)
def test_full_layout_files_that_ask_to_run_code_are_refused(tmp_path, name):
    objs = make()
    train_steps(*objs, 2)
    ck = objs[0].save_state(tmp_path / "ck", safe_serialization=False)
    marker = tmp_path / "marker"
    craft_torch_file(ck, name, marker)
    named = (
        re.escape(f"'{os.path.join(ck, name)}'") if name == "pytorch_model.bin" else re.escape(f"cannot read '{name}'")
    )
    _refused(ck, rf"{named}.*{ASKED}")  # nothing restored
    with pytest.raises(UnsafeCheckpoint):
        objs[0].load_state(ck)
    assert not marker.exists()
    if name == "pytorch_model.bin":  # merge-weights reads the same file the same way
        with pytest.raises(UnsafeCheckpoint, match=ASKED):
            merge_weights(ck, tmp_path / "merged")
        assert not marker.exists() and not (tmp_path / "merged").exists()


def test_load_model_refuses_a_model_file_that_asks_to_run_code(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(4, 2))
    acc.save_model(model, tmp_path / "saved", safe_serialization=False)
    marker = tmp_path / "marker"
    craft_torch_file(tmp_path / "saved", "pytorch_model.bin", marker, manifest=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        UnsafeCheckpoint, match=rf"cannot read the model weights .*pytorch_model\.bin'.*{ASKED}; nothing was loaded"
    ):
        load_model(model, tmp_path / "saved")
    assert not marker.exists() and _same(changed, dict(model.state_dict())) and not _same(before, changed)


# ---------------------------------------------------------------------- damaged .metadata (item 8)


@pytest.mark.parametrize("how", ["flip", "cut", "garbage"])
def test_a_damaged_dcp_metadata_is_one_line(dcp_checkpoint, tmp_path, capfd, how):
    acc, model, _, good = dcp_checkpoint
    before = _weights(acc, model)
    checked = _copy(good, tmp_path, "checked")
    damage_metadata(checked, how)  # the manifest's record as saved: the checksum (or size) finds it
    found = "do not match their checksum" if how != "cut" else "has \\d+ bytes, the manifest says"
    with pytest.raises(DamagedCheckpoint, match=rf"damaged: 'model_0/\.metadata' .*{found}"):
        acc.load_state(checked)
    forged = _copy(good, tmp_path, "forged")
    damage_metadata(forged, how, recompute=True)  # the manifest agrees: unpickling finds it
    for ck, verify in ((forged, True), (forged, False), (checked, False)):
        if how == "cut" and ck == checked:
            continue  # the size is checked even unverified
        with pytest.raises(DamagedCheckpoint) as caught:
            acc.load_state(ck, verify_checksums=verify)
        assert type(caught.value) in (DamagedCheckpoint, UnsafeCheckpoint)  # garbage may name a "class"
        assert "\n" not in str(caught.value) and "'model_0/.metadata'" in str(caught.value)
    out = capfd.readouterr()
    assert "Global metadata is not found" not in out.err + out.out and "AssertionError" not in out.err + out.out
    assert _same(before, _weights(acc, model))


def test_two_processes_refuse_crafted_and_damaged_files_in_one_line(tmp_path):
    """On 2 gloo processes through hasten launch: every process refuses, nothing runs, nothing is
    restored, the untouched checkpoint loads; a damaged .metadata is the launcher's one line."""
    proc = launch(
        "--num_processes", "2", "--main_process_port", str(free_port()), SCRIPTS / "trust_dcp.py", tmp_path, timeout=150
    )
    ranks = read_ranks(tmp_path, 2)
    for rank in ranks:
        assert rank["good_loads"], rank
        for name in ("metadata_payload", "metadata_payload_unverified", "item_payload"):
            assert rank[name]["error"].startswith("UnsafeCheckpoint: ") and "'posix.system'" in rank[name]["error"], (
                rank[name]
            )
            assert not rank[name]["marker"] and rank[name]["unchanged"], (name, rank[name])
        assert "'model_0/.metadata' bytes 0-" in rank["metadata_flip"]["error"]
        for name in ("metadata_flip", "metadata_flip_recomputed", "metadata_flip_unverified"):
            assert rank[name]["error"].startswith("DamagedCheckpoint: ") and rank[name]["unchanged"], rank[name]
            assert "\n" not in rank[name]["error"]
        assert "'model_0/.metadata' cannot be read" in rank["metadata_flip_recomputed"]["error"]
    assert ranks[0]["item_payload"]["error"] == ranks[1]["item_payload"]["error"]  # the same error everywhere
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if "failed with DamagedCheckpoint" in line]
    assert len(summary) == 1 and "'model_0/.metadata' cannot be read" in summary[0], proc.stderr[-3000:]
    for noise in ("Global metadata is not found", "AssertionError", "CheckpointException", "Rank local metadata"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------- manifest fields (item 9)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("world_size", 0, "an integer >= 1"),
        ("world_size", -2, "an integer >= 1"),
        ("world_size", "2", "an integer >= 1"),
        ("world_size", True, "an integer >= 1"),
        ("format_version", 0, "an integer >= 1"),
        ("format_version", "1", "an integer >= 1"),
        ("counts", {"models": -1}, "names and counts"),
        ("scaler", "yes", "true or false"),
        ("files", [], "an object of file names"),
    ],
)
def test_a_manifest_field_no_save_writes_is_refused_naming_it(tmp_path, field, value, allowed):
    objs = make()
    train_steps(*objs, 1)
    ck = objs[0].save_state(tmp_path / "ck")
    edit_manifest(ck, **{field: value})
    _refused(
        ck,
        re.escape(f"hasten_checkpoint.json' is damaged: {field} is {value!r}; it must be ") + ".*" + re.escape(allowed),
    )
    with pytest.raises(DamagedCheckpoint) as caught:
        objs[0].load_state(ck)
    assert "\n" not in str(caught.value)


def test_a_file_record_or_tensor_table_no_save_writes_is_refused_naming_it(tmp_path):
    objs = make()
    train_steps(*objs, 1)
    ck = objs[0].save_state(tmp_path / "ck")
    manifest_path = os.path.join(ck, "hasten_checkpoint.json")
    good = json.load(open(manifest_path))
    for edit, words in (
        (lambda m: m["files"]["optimizer.bin"].update(size=-5), "files['optimizer.bin'].size is -5"),
        (lambda m: m["files"]["optimizer.bin"].update(xxh3_128=7), "files['optimizer.bin'].xxh3_128 is 7"),
        (
            lambda m: m["models"][0]["tensors"]["0.weight"].update(shape=[6, "4"]),
            "models[0].tensors['0.weight'].shape is [6, '4']",
        ),
    ):
        manifest = json.loads(json.dumps(good))
        edit(manifest)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        with pytest.raises(DamagedCheckpoint) as caught:
            objs[0].load_state(ck)
        assert words in str(caught.value), str(caught.value)
    with open(manifest_path, "w") as f:
        json.dump(good, f)
    objs[0].load_state(ck)


# ---------------------------------------------------------------------- warnings (item 10)


def test_save_and_load_leave_once_only_warnings_shown_once(tmp_path):
    """warnings.catch_warnings around each DCP call reset Python's registry of warnings shown,
    so torch's (and the script's) once-only warnings came back after every save_state."""
    code = textwrap.dedent(f"""
        import warnings
        import torch
        from hasten import Accelerator, FullyShardedDataParallelPlugin

        def helper():
            warnings.warn("hasten-test: a once-only warning", UserWarning)

        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
        model = torch.nn.Linear(4, 2)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        acc.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        helper()
        for _ in range(2):
            acc.save_state({str(tmp_path / "ck")!r})
        acc.load_state({str(tmp_path / "ck")!r})
        helper()
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("hasten-test: a once-only warning") == 1, proc.stderr[-3000:]
    assert "torch.distributed is disabled" not in proc.stderr  # DCP's one-process warning is still silenced
