"""Placing models across devices (hasten.big_modeling, built in hasten.big_model.dispatch/loading):
dispatch_model by a device map with CPU and disk blocks, cpu_offload, disk_offload,
load_checkpoint_in_model with a device map and an offload folder, load_checkpoint_and_dispatch;
offloaded weights on the meta device between forwards, read from the checkpoint's own safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from big_model_cases import ModelForTest, Tiny
from hasten.big_modeling import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from hasten.utils.modeling import (
    get_non_persistent_buffers,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    infer_auto_device_map,
    load_checkpoint_in_model,
    set_module_tensor_to_device,
)

META = torch.device("meta")
CPU = torch.device("cpu")
MIXED = {"embed": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "disk", "layers.3": "cpu", "norm": "disk"}
MIXED |= {"head": "cpu", "pos": "cpu"}


def _ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(1))


def _save(model: torch.nn.Module, folder) -> str:
    from safetensors.torch import save_file

    path = os.path.join(folder, "model.safetensors")
    save_file({k: v.clone() for k, v in model.state_dict().items()}, path, metadata={"format": "pt"})
    return path


def test_dispatch_model_with_cpu_and_disk_blocks(tmp_path):
    model = Tiny(tie=False)
    expected = model(_ids())
    dispatched = dispatch_model(model, dict(MIXED), offload_dir=tmp_path / "offload")
    assert dispatched is model and model.hf_device_map == MIXED
    assert model.layers[1].attn.weight.device == META and model.norm.weight.device == META
    assert model.layers[0].attn.weight.device == CPU  # main device is the CPU: cpu blocks stay in memory
    torch.testing.assert_close(model(_ids()), expected)
    torch.testing.assert_close(model(_ids()), expected)
    # a disk-offloaded model holds its offloaded weights on meta between forwards
    assert all(p.device == META for p in model.layers[1].parameters())
    assert all(p.device == META for p in model.norm.parameters())
    assert sorted(os.listdir(tmp_path / "offload"))[0] == "index.json"
    with pytest.raises(RuntimeError, match="offloaded to cpu or disk"):
        model.to("cpu")


def test_dispatch_model_needs_an_offload_dir_for_disk():
    model = Tiny(tie=False)
    with pytest.raises(ValueError, match="need an `offload_dir`.*layers.1"):
        dispatch_model(model, dict(MIXED))
    with pytest.raises(ValueError, match="does not give any device.*norm.weight"):
        dispatch_model(model, {k: v for k, v in MIXED.items() if k != "norm"})


def test_dispatch_model_one_device_moves_the_model():
    model = ModelForTest()
    dispatch_model(model, {"": "cpu"})
    assert not hasattr(model, "_hf_hook") and model.hf_device_map == {"": "cpu"}
    dispatch_model(model, {"": "cpu"}, force_hooks=True)
    assert hasattr(model, "_hf_hook")


def test_dispatch_tied_model(tmp_path):
    model = Tiny(tie=True)
    expected = model(_ids())
    device_map = {"embed": "cpu", "layers": "disk", "norm": "cpu", "head": "disk", "pos": "cpu"}
    dispatch_model(model, device_map, offload_dir=tmp_path)
    torch.testing.assert_close(model(_ids()), expected)
    torch.testing.assert_close(model(_ids()), expected)  # the tied copy made for a forward is dropped after
    assert model.head.weight.device == META


def test_cpu_offload_and_disk_offload(tmp_path):
    model = Tiny(tie=False)
    expected = model(_ids())
    cpu_offload(model, execution_device="cpu")
    assert all(p.device == META for p in model.parameters())
    torch.testing.assert_close(model(_ids()), expected)
    model = Tiny(tie=False)
    expected = model(_ids())
    disk_offload(model, tmp_path, execution_device="cpu")
    assert (tmp_path / "index.json").is_file() and (tmp_path / "head.weight.dat").is_file()
    torch.testing.assert_close(model(_ids()), expected)
    assert all(p.device == META for p in model.parameters())


def test_load_checkpoint_in_model_disk_offload_accelerate_case(tmp_path):
    device_map = {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"}
    for buffers in (False, True):
        model = ModelForTest()
        path = tmp_path / f"model{buffers}.bin"
        torch.save(model.state_dict(), path)
        load_checkpoint_in_model(
            model, path, device_map=device_map, offload_folder=tmp_path / "o", offload_buffers=buffers
        )
        assert model.linear1.weight.device == CPU and model.linear2.weight.device == CPU
        assert model.batchnorm.weight.device == META
        assert model.batchnorm.running_mean.device == (META if buffers else CPU)
        index = json.loads((tmp_path / "o" / "index.json").read_text())
        assert index["batchnorm.weight"] == {"dtype": "float32", "shape": [4]}  # a torch file: copied to .dat
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(ModelForTest(), path, device_map=device_map)
    with pytest.raises(NotImplementedError, match="offload_8bit_bnb"):
        load_checkpoint_in_model(
            ModelForTest(), path, device_map=device_map, offload_folder=tmp_path, offload_8bit_bnb=True
        )


def test_disk_weights_are_read_from_the_checkpoints_safetensors(tmp_path):
    source = Tiny(tie=False)
    checkpoint = _save(source, tmp_path)
    with init_empty_weights():
        model = Tiny(tie=False)
    offload = tmp_path / "offload"
    load_checkpoint_in_model(model, checkpoint, device_map=dict(MIXED), offload_folder=offload)
    index = json.loads((offload / "index.json").read_text())
    assert index["norm.weight"] == {
        "safetensors_file": os.path.abspath(checkpoint),
        "weight_name": "norm.weight",
        "dtype": "float32",
    }
    assert os.listdir(offload) == ["index.json"]  # nothing copied
    with init_empty_weights():
        half = Tiny(tie=False)
    load_checkpoint_in_model(half, checkpoint, device_map=dict(MIXED), offload_folder=tmp_path / "h", dtype="float16")
    index = json.loads((tmp_path / "h" / "index.json").read_text())
    assert index["norm.weight"] == {"dtype": "float16", "shape": [8]}  # another dtype: written as .dat


def test_load_checkpoint_and_dispatch_auto(tmp_path):
    source = Tiny(tie=False)
    expected = source(_ids())
    _save(source, tmp_path)
    with init_empty_weights():
        model = Tiny(tie=False)
    budget = {"cpu": 3000}
    planned = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=["Block"])
    assert "disk" in planned.values() and "cpu" in planned.values()
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path,
        device_map="auto",
        max_memory=budget,
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "o",
    )
    assert model.hf_device_map == planned
    torch.testing.assert_close(model(_ids()), expected)
    with pytest.raises(ValueError, match="'auto', 'balanced'"):
        load_checkpoint_and_dispatch(Tiny(), tmp_path, device_map="everywhere")


def test_load_checkpoint_and_dispatch_offload_state_dict(tmp_path):
    source = Tiny(tie=True)
    expected = source(_ids())
    _save(source, tmp_path)
    with init_empty_weights():
        model = Tiny(tie=True)
    device_map = {"embed": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu", "layers.3": "disk"}
    device_map |= {"norm": "cpu", "head": "cpu", "pos": "cpu"}
    model = load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path / "o")
    assert model.layers[0].attn.weight.device == CPU and model.layers[1].attn.weight.device == META
    torch.testing.assert_close(model(_ids()), expected)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="transformers is not installed"
)
@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_transformers_from_pretrained_device_map_auto_on_hasten():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "scripts" / "big_model_transformers.py"
    done = subprocess.run([sys.executable, str(script), "hasten"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "hasten" in found["accelerate"]  # accelerate was hasten
    assert {"cpu", "disk"} <= set(found["map"].values())
    assert found["logits"] and found["generate"]
    assert found["offloaded_after_forward"] == "meta"
    real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    if real.returncode == 0:  # Accelerate itself is installed: its map is the same
        reference = json.loads(real.stdout.strip().splitlines()[-1])
        assert "hasten" not in reference["accelerate"]
        assert found["map"] == reference["map"]


def test_offload_to_cpu_0_keeps_parameters(tmp_path):
    """diffusers' CPU offload asks for "cpu:0": a parameter moved there for a forward stays a
    parameter (a plain tensor there made the next move fail, as in Accelerate 1.15)."""
    for offload in (cpu_offload, lambda m, execution_device: disk_offload(m, tmp_path, execution_device)):
        model = Tiny(tie=False)
        expected = model(_ids())
        offload(model, execution_device="cpu:0")
        for _ in range(2):
            torch.testing.assert_close(model(_ids()), expected)
        assert all(type(p) is torch.nn.Parameter and p.device == META for p in model.parameters())
    plain = nn.Linear(2, 2)
    set_module_tensor_to_device(plain, "weight", "cpu:0", value=torch.ones(2, 2))
    assert type(plain.weight) is torch.nn.Parameter and plain.weight.requires_grad


def test_get_state_dict_offloaded_model(tmp_path):
    source = Tiny(tie=False)
    expected = source.state_dict()
    _save(source, tmp_path)
    with init_empty_weights():
        model = Tiny(tie=False)
    device_map = {"embed": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu", "layers.3": "disk"}
    device_map |= {"norm": "disk", "head": "cpu", "pos": "cpu"}
    model = load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path / "o")
    found = get_state_dict_offloaded_model(model)
    assert found.keys() == expected.keys()
    for key, tensor in expected.items():
        assert found[key].device == CPU and torch.equal(found[key], tensor), key
    assert model.layers[1].attn.weight.device == META  # read for the copy, dropped after
    partial = {"layers.1.attn.weight": None, "layers.1.attn.bias": None}
    get_state_dict_from_offload(model.layers[1].attn, "layers.1.attn.weight", partial)
    assert torch.equal(partial["layers.1.attn.weight"], expected["layers.1.attn.weight"])


def test_get_non_persistent_buffers():
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_buffer("kept", torch.ones(1))
    model.register_buffer("scratch", torch.ones(1), persistent=False)
    model[0].register_buffer("inner", torch.ones(1), persistent=False)
    assert get_non_persistent_buffers(model) == {"scratch"}
    assert get_non_persistent_buffers(model, recurse=True) == {"scratch", "inner"}
    assert {"scratch", "0.inner"} <= get_non_persistent_buffers(model, recurse=True, fqns=True)


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_accelerator_save_model_of_an_offloaded_model(tmp_path, safe_serialization):
    """Accelerate's test_save_model_offload: save_model reads the offloaded weights back."""
    from hasten import Accelerator

    accelerator = Accelerator()
    model, x = ModelForTest().eval(), torch.randn(3, 3)
    expected = model(x)
    accelerator.save_model(model, tmp_path, safe_serialization=safe_serialization)
    device_map = {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"}
    load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path / "o")
    assert model.batchnorm.weight.device == META
    saved = tmp_path / "saved"
    accelerator.save_model(model, saved, safe_serialization=safe_serialization)
    fresh = ModelForTest().eval()
    load_checkpoint_and_dispatch(fresh, saved)
    torch.testing.assert_close(fresh(x), expected)
