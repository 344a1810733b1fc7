"""The offload folder (hasten.utils.offload, built in hasten.big_model.offload): Accelerate's format
(raw .dat files and index.json), read back without unpickling, lazily, and from safetensors entries."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from hasten.utils.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offload_weight_round_trip(tmp_path, dtype):
    weight = (torch.randn(3, 5) * 4).to(dtype)
    index = offload_weight(weight, "layer.weight", tmp_path, index={})
    assert index == {"layer.weight": {"dtype": str(dtype).split(".")[1], "shape": [3, 5]}}
    back = load_offloaded_weight(tmp_path / "layer.weight.dat", index["layer.weight"])
    assert back.dtype == dtype and back.shape == (3, 5)
    assert torch.equal(back.view(torch.uint8), weight.view(torch.uint8))


def test_dat_files_are_accelerates_format(tmp_path):
    # Accelerate writes numpy memmaps of the raw values (bf16 as int16): the same bytes, so folders
    # written by one are read by the other.
    weight = torch.randn(4, 2)
    offload_weight(weight, "w", tmp_path)
    assert np.array_equal(np.fromfile(tmp_path / "w.dat", dtype=np.float32).reshape(4, 2), weight.numpy())
    scalar = torch.tensor(3.5)
    index = offload_weight(scalar, "s", tmp_path, index={})
    assert index["s"]["shape"] == [] and (tmp_path / "s.dat").stat().st_size == 4
    assert load_offloaded_weight(tmp_path / "s.dat", index["s"]).item() == 3.5


def test_reading_never_unpickles(tmp_path, monkeypatch):
    offload_state_dict(tmp_path, {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.bfloat16)})

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    assert torch.equal(loader["a"], torch.ones(2)) and loader["b"].dtype == torch.bfloat16


def test_bad_index_entries_are_refused(tmp_path):
    offload_weight(torch.ones(2, 2), "w", tmp_path)
    with pytest.raises(ValueError, match="dtype 'os.system' is not a torch dtype"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "os.system", "shape": [2, 2]})
    with pytest.raises(ValueError, match="dtype 'Tensor' is not a torch dtype"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "Tensor", "shape": [2, 2]})
    with pytest.raises(ValueError, match="holds 16 bytes"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [3, 2]})
    with pytest.raises(ValueError, match="shape must be a list"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": "2,2"})
    with pytest.raises(ValueError, match="meta device"):
        offload_weight(torch.empty(2, device="meta"), "m", tmp_path)


def test_offload_state_dict_and_index_merge(tmp_path):
    offload_state_dict(tmp_path, {"a.weight": torch.ones(2)})
    save_offload_index({"b.weight": {"dtype": "float16", "shape": [1]}}, tmp_path)
    save_offload_index({}, tmp_path)  # nothing to add
    index = json.loads((tmp_path / "index.json").read_text())
    assert index == {"a.weight": {"dtype": "float32", "shape": [2]}, "b.weight": {"dtype": "float16", "shape": [1]}}


def test_offloaded_weights_loader(tmp_path):
    from safetensors.torch import save_file

    offload_state_dict(tmp_path, {"disk.weight": torch.full((2,), 2.0)})
    save_file({"in_file": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    index = json.loads((tmp_path / "index.json").read_text())
    index["st.weight"] = {"safetensors_file": str(tmp_path / "model.safetensors"), "weight_name": "in_file"}
    index["st.half"] = {**index["st.weight"], "dtype": "float16"}
    loader = OffloadedWeightsLoader(state_dict={"cpu.weight": torch.ones(1)}, save_folder=tmp_path, index=index)
    assert list(loader) == ["cpu.weight", "disk.weight", "st.weight", "st.half"] and len(loader) == 4
    assert torch.equal(loader["cpu.weight"], torch.ones(1))
    assert torch.equal(loader["disk.weight"], torch.full((2,), 2.0))
    assert torch.equal(loader["st.weight"], torch.arange(4.0))
    assert loader["st.half"].dtype == torch.float16
    with pytest.raises(ValueError, match="Need either"):
        OffloadedWeightsLoader()


def test_prefixed_dataset_and_extract():
    data = {"a.x": 1, "a.y": 2, "ab.z": 3}
    view = PrefixedDataset(data, "a.")
    assert view["x"] == 1 and list(view) == ["a.x", "a.y"] and len(view) == 3
    state = {"h.1.w": 1, "h.10.w": 2, "h.1": 3}
    assert extract_submodules_state_dict(state, ["h.1"]) == {"h.1.w": 1, "h.1": 3}
