"""Issue 48, the last 49 ``accelerate.utils`` names: each imports from ``hasten.utils`` and from
Accelerate's module path under it, and does what Accelerate 1.15's does (the expected values
below are what Accelerate's functions return on the same inputs), or is refused naming what to
use. One process here; the FSDP2 helpers and the collectives on 2 processes in
scripts/utils5_fsdp.py.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import types
from importlib.machinery import ModuleSpec

import pytest
import torch
from torch import nn

import hasten.utils as U
from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint.errors import UnsafeCheckpoint
from hasten.utils import environment as E
from hasten.utils import imports as I
from launch_utils import SCRIPTS, free_port, launch

# Accelerate 1.15's module of each name (src/accelerate/utils/*.py), under hasten.utils.
HOMES = {
    "modeling": [
        "find_tied_parameters", "retie_parameters", "set_module_tensor_to_device", "named_module_tensors",
        "compute_module_sizes", "dtype_byte_size", "get_max_layer_size", "load_checkpoint_in_model",
        "load_state_dict", "is_peft_model", "id_tensor_storage", "convert_file_size_to_int",
        "calculate_maximum_sizes", "check_tied_parameters_in_config",
    ],
    "offload": ["extract_submodules_state_dict", "PrefixedDataset"],
    "other": [
        "clean_state_dict_for_safetensors", "get_module_children_bottom_up", "compile_regions_fsdp2",
        "compile_regions_deepspeed",
    ],
    "fsdp_utils": [
        "ensure_weights_retied", "fsdp2_prepare_model", "fsdp2_load_full_state_dict",
        "fsdp2_switch_optimizer_parameters", "fsdp2_apply_ac", "fsdp2_canonicalize_names", "get_fsdp2_grad_scaler",
        "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading",
    ],
    "ao": ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"],
    "transformer_engine": [
        "apply_fp8_autowrap", "contextual_fp8_autocast", "has_transformer_engine_layers", "convert_model",
    ],
    "imports": ["torchao_required", "deepspeed_required"],
    "environment": [
        "check_cuda_fp8_capability", "get_cpu_distributed_information", "get_current_device_type", "get_gpu_info",
    ],
    "dataclasses": ["TorchTensorParallelPlugin"],
    "launch": ["PrepareForLaunch", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env"],
    "operations": ["GatheredParameters", "copy_tensor_to_devices"],
    "megatron_lm": ["avg_losses_across_data_parallel_group"],
}  # fmt: skip


def test_every_name_is_in_hasten_utils_and_at_accelerates_module_path():
    names = [n for ns in HOMES.values() for n in ns]
    assert len(names) == len(set(names)) == 49
    for module, ns in HOMES.items():
        home = importlib.import_module(f"hasten.utils.{module}")
        for name in ns:
            assert name in home.__all__ and name in U.__all__, (module, name)
            assert getattr(U, name) is getattr(home, name), (module, name)


# --------------------------------------------------------------------------- a model to measure
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("cache", torch.ones(4), persistent=False)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.float16))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


# What Accelerate 1.15's functions return for _net() (run side by side on torch 2.13).
SIZES = {
    "": 1108,
    "embed": 320,
    "embed.weight": 320,
    "layers": 784,
    "layers.0": 392,
    "layers.0.cache": 16,
    "layers.0.fc": 288,
    "layers.0.fc.bias": 32,
    "layers.0.fc.weight": 256,
    "layers.0.norm": 64,
    "layers.0.norm.bias": 32,
    "layers.0.norm.weight": 32,
    "layers.0.steps": 24,
    "layers.1": 392,
    "layers.1.cache": 16,
    "layers.1.fc": 288,
    "layers.1.fc.bias": 32,
    "layers.1.fc.weight": 256,
    "layers.1.norm": 64,
    "layers.1.norm.bias": 32,
    "layers.1.norm.weight": 32,
    "layers.1.steps": 24,
    "scale": 4,
}
SIZES_FP16 = {  # dtype="float16", special_dtypes={"head.weight": torch.float64} (head.weight is a tied name)
    "": 580,
    "embed": 160,
    "embed.weight": 160,
    "layers": 416,
    "layers.0": 208,
    "layers.0.cache": 8,
    "layers.0.fc": 144,
    "layers.0.fc.bias": 16,
    "layers.0.fc.weight": 128,
    "layers.0.norm": 32,
    "layers.0.norm.bias": 16,
    "layers.0.norm.weight": 16,
    "layers.0.steps": 24,
    "layers.1": 208,
    "layers.1.cache": 8,
    "layers.1.fc": 144,
    "layers.1.fc.bias": 16,
    "layers.1.fc.weight": 128,
    "layers.1.norm": 32,
    "layers.1.norm.bias": 16,
    "layers.1.norm.weight": 16,
    "layers.1.steps": 24,
    "scale": 4,
}
SIZES_BUFFERS_BF16 = {
    "": 64, "layers": 64, "layers.0": 32, "layers.0.cache": 8, "layers.0.steps": 24, "layers.1": 32,
    "layers.1.cache": 8, "layers.1.steps": 24,
}  # fmt: skip


def test_tied_parameters_found_and_tied_again():
    model = _net()
    assert U.find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    assert U.find_tied_parameters(nn.Linear(2, 2)) == []
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # the link broken
    assert U.find_tied_parameters(model) == []
    U.retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.head.weight is model.embed.weight
    # the first parameter of a group not on the meta device is the one kept
    with torch.device("meta"):
        model.embed.weight = nn.Parameter(torch.empty(10, 8))
    real = nn.Parameter(torch.ones(10, 8))
    model.head.weight = real
    U.retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.embed.weight is real and model.head.weight is real


def test_sizes_are_accelerates():
    model = _net()
    assert dict(U.compute_module_sizes(model)) == SIZES
    special = {"head.weight": torch.float64}
    assert dict(U.compute_module_sizes(model, dtype="float16", special_dtypes=special)) == SIZES_FP16
    assert dict(U.compute_module_sizes(model, dtype=torch.bfloat16, buffers_only=True)) == SIZES_BUFFERS_BF16
    assert U.calculate_maximum_sizes(model) == (1108, (392, ["layers.0", "layers.1"]))  # Block kept whole
    assert U.get_max_layer_size(list(model.named_children()), U.compute_module_sizes(model), []) == (320, ["embed"])
    dtypes = (torch.float32, torch.bfloat16, torch.bool, torch.int8, torch.float8_e4m3fn, torch.complex64)
    assert [U.dtype_byte_size(d) for d in dtypes] == [4, 2, 0.125, 1, 1, 8]
    custom = (U.CustomDtype.INT4, U.CustomDtype.INT2, U.CustomDtype.FP8)
    assert [U.dtype_byte_size(d) for d in custom] == [0.5, 0.25, 1]


def test_convert_file_size_to_int_is_accelerates():
    sizes = (123, "1MiB", "2GIB", "5MB", "5Mb", "1.5GB", "3KB", "3kb", "7KiB")
    assert [U.convert_file_size_to_int(s) for s in sizes] == [
        123, 1048576, 2147483648, 5000000, 625000, 1500000000, 3000, 375, 7168
    ]  # fmt: skip
    for bad in ("12", "MB", "x5GB", -1):
        with pytest.raises(ValueError, match="not in a valid format"):
            U.convert_file_size_to_int(bad)


def test_module_walks_and_tensor_names_are_accelerates():
    model = _net()
    order = U.get_module_children_bottom_up(model, return_fqns=True)
    assert [n for n, _ in order] == [
        "embed", "layers.0.norm", "layers.0.fc", "layers.0", "layers.1.norm", "layers.1.fc", "layers.1", "layers",
        "head", "",
    ]  # fmt: skip
    assert U.get_module_children_bottom_up(model)[-1] is model
    assert [n for n, _ in U.named_module_tensors(model.layers[0], recurse=True)] == [
        "norm.weight", "norm.bias", "fc.weight", "fc.bias", "steps", "cache"
    ]  # fmt: skip
    assert [n for n, _ in U.named_module_tensors(model, include_buffers=False)] == ["scale"]
    kept = [n for n, _ in U.named_module_tensors(model.layers[0], remove_non_persistent=True)]
    assert kept == ["steps"]  # the own buffers, the non-persistent one left out
    # with recurse Accelerate matches the buffers' own names against full names: nothing is left out
    assert len(list(U.named_module_tensors(model, recurse=True, remove_non_persistent=True))) == 14


def test_storage_ids_and_clean_state_dict(caplog):
    model = _net()
    assert U.id_tensor_storage(model.embed.weight) == U.id_tensor_storage(model.head.weight)
    assert U.id_tensor_storage(model.embed.weight[1:]) == U.id_tensor_storage(model.embed.weight)
    assert U.id_tensor_storage(model.scale) != U.id_tensor_storage(model.embed.weight)
    state = model.state_dict()
    with caplog.at_level(logging.WARNING, logger="hasten.utils.other"):
        cleaned = U.clean_state_dict_for_safetensors(state)
    assert "head.weight" not in cleaned and "head.weight" not in state  # removed from the dict given too
    assert "Removed shared tensor {'head.weight'}" in caplog.text
    assert len(cleaned) == 12 and all(t.is_contiguous() for t in cleaned.values())
    assert U.clean_state_dict_for_safetensors({"t": torch.ones(3, 2).t()})["t"].is_contiguous()


def test_state_dict_helpers():
    assert U.fsdp2_canonicalize_names({"_orig_mod.a._checkpoint_wrapped_module.w": 1, "b._orig_mod.c": 2}) == {
        "a.w": 1,
        "b.c": 2,
    }
    extracted = U.extract_submodules_state_dict({"h.1.w": 1, "h.10.w": 2, "h.1": 3, "g": 4}, ["h.1", "g"])
    assert extracted == {"h.1.w": 1, "h.1": 3, "g": 4}
    view = U.PrefixedDataset({"a.x": 1, "a.y": 2, "b.z": 3}, "a.")
    assert (list(view), len(view), view["x"]) == (["a.x", "a.y"], 3, 1)  # Accelerate's iteration and len


# --------------------------------------------------------------------------- set_module_tensor_to_device
def test_set_module_tensor_to_device_as_accelerate():
    with torch.device("meta"):
        lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device, we need a `value`"):
        U.set_module_tensor_to_device(lin, "weight", "cpu")
    U.set_module_tensor_to_device(lin, "weight", "cpu", value=torch.ones(2, 2, dtype=torch.float64))
    assert type(lin.weight) is nn.Parameter and lin.weight.requires_grad
    assert (lin.weight.device.type, lin.weight.dtype) == ("cpu", torch.float32)  # the old dtype
    U.set_module_tensor_to_device(lin, "bias", "cpu", value=torch.ones(2), dtype=torch.bfloat16)
    assert lin.bias.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shape"):
        U.set_module_tensor_to_device(lin, "bias", "cpu", value=torch.ones(3))
    with pytest.raises(ValueError, match="does not have a parameter or a buffer named nope"):
        U.set_module_tensor_to_device(lin, "nope", "cpu")
    U.set_module_tensor_to_device(lin, "weight", "meta", dtype=torch.float16)
    assert (lin.weight.device.type, lin.weight.dtype, type(lin.weight)) == ("meta", torch.float16, nn.Parameter)
    seq = nn.Sequential(nn.BatchNorm1d(2))  # a dotted buffer name; an integer keeps its dtype
    U.set_module_tensor_to_device(seq, "0.num_batches_tracked", "cpu", value=torch.tensor(5), dtype=torch.float16)
    assert seq[0].num_batches_tracked.dtype == torch.int64 and int(seq[0].num_batches_tracked) == 5
    same = nn.Linear(2, 2)
    weight = same.weight
    U.set_module_tensor_to_device(same, "weight", "cpu")
    assert same.weight is weight  # already there: left as it is
    shared, tied = torch.ones(2, 2), {}
    tied[shared.data_ptr()] = {}
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    U.set_module_tensor_to_device(a, "weight", "cpu", value=shared, tied_params_map=tied)
    U.set_module_tensor_to_device(b, "weight", "cpu", value=shared, tied_params_map=tied)
    assert a.weight is b.weight
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        U.set_module_tensor_to_device(a, "weight", "cpu", value=shared, fp16_statistics=torch.ones(2))


# --------------------------------------------------------------------------- loading checkpoints
def _small(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    model.register_buffer("count", torch.tensor([7], dtype=torch.int64))
    return model


def _sharded(folder, extra: bool = True) -> dict[str, torch.Tensor]:
    """``folder`` holds a 2-shard safetensors checkpoint of _small(1) with its index (as
    ``save_pretrained`` writes it), plus a name the model lacks with ``extra``."""
    from safetensors.torch import save_file

    source = _small(1).state_dict()
    keys = list(source)
    shards = {"model-00001-of-00002.safetensors": keys[:3], "model-00002-of-00002.safetensors": keys[3:]}
    weight_map = {}
    for name, part in shards.items():
        tensors = {k: source[k].contiguous() for k in part}
        if extra and name.startswith("model-00002"):
            tensors["extra.w"] = torch.zeros(1)
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return source


def _equal(model: nn.Module, source: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, source[k]) for k, t in model.state_dict().items())


def test_load_checkpoint_in_model_sharded_index(tmp_path, caplog):
    source = _sharded(tmp_path)
    model = _small(0)
    with caplog.at_level(logging.WARNING, logger="hasten.utils.modeling"):
        U.load_checkpoint_in_model(model, tmp_path)  # the folder: its one index
    assert _equal(model, source)
    assert "were not used when initializing Sequential: {'extra.w'}" in caplog.text
    model = _small(0)
    U.load_checkpoint_in_model(model, tmp_path / "model.safetensors.index.json", device_map={"": "cpu"},
                               dtype="float16", keep_in_fp32_modules=["2"])  # fmt: skip
    dtypes = {k: t.dtype for k, t in model.state_dict().items()}
    assert dtypes == {
        "0.weight": torch.float16, "0.bias": torch.float16, "1.weight": torch.float16, "1.bias": torch.float16,
        "2.weight": torch.float32, "2.bias": torch.float32, "count": torch.int64,
    }  # fmt: skip
    assert torch.equal(model[0].weight, source["0.weight"].half())
    with pytest.raises(ValueError, match="count doesn't have any device set"):
        U.load_checkpoint_in_model(_small(0), tmp_path, device_map={"0": "cpu"})


def test_load_checkpoint_in_model_strict(tmp_path):
    _sharded(tmp_path)
    model = _small(0)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \['extra.w'\]"):
        U.load_checkpoint_in_model(model, tmp_path, strict=True)
    assert _equal(model, before)  # checked before any shard was loaded
    clean = tmp_path / "clean"
    clean.mkdir()
    source = _sharded(clean, extra=False)
    model = _small(0)
    # Accelerate checks each shard alone, so strict=True fails on any sharded checkpoint; here it loads
    U.load_checkpoint_in_model(model, clean, strict=True)
    assert _equal(model, source)


def test_load_checkpoint_in_model_files_ties_and_meta(tmp_path):
    from safetensors.torch import save_file

    source = _small(1).state_dict()
    torch.save(source, tmp_path / "w.bin")
    model = _small(0)
    U.load_checkpoint_in_model(model, tmp_path / "w.bin", strict=True)
    assert _equal(model, source)
    tied = _net()
    save_file({k: t for k, t in U.clean_state_dict_for_safetensors(tied.state_dict()).items()},
              tmp_path / "tied.safetensors", metadata={"format": "pt"})  # fmt: skip
    fresh = Net()
    U.load_checkpoint_in_model(fresh, tmp_path / "tied.safetensors")
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.head.weight, tied.embed.weight)
    for device_map in ({"": "cpu"}, None):  # a model built on meta: placed by the map, or taken as it is
        with torch.device("meta"):
            meta = _small(0)
        U.load_checkpoint_in_model(meta, tmp_path / "w.bin", device_map=device_map)
        assert not any(t.is_meta for t in meta.state_dict().values()) and _equal(meta, source)


def test_load_checkpoint_in_model_reads_what_hasten_saves(tmp_path):
    model = _net()
    Accelerator(cpu=True).save_model(model, tmp_path, max_shard_size="200B")  # tied weight stored once
    assert (tmp_path / "model.safetensors.index.json").exists()
    fresh = Net()
    U.load_checkpoint_in_model(fresh, tmp_path, strict=True)
    assert _equal(fresh, model.state_dict()) and fresh.head.weight is fresh.embed.weight


def test_load_checkpoint_refusals(tmp_path):
    _sharded(tmp_path)
    # disk offload is big-model loading's (tests/test_big_model_dispatch.py); without a folder it is refused
    with pytest.raises(ValueError, match="please pass along an `offload_folder`"):
        U.load_checkpoint_in_model(_small(0), tmp_path, device_map={"": "disk"})
    with pytest.raises(ValueError, match="should be the path to a file"):
        U.load_checkpoint_in_model(_small(0), tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a folder containing"):
        U.load_checkpoint_in_model(_small(0), tmp_path / "empty")
    (tmp_path / "other.index.json").write_text("{}")
    with pytest.raises(ValueError, match="more than one `.index.json`"):
        U.load_checkpoint_in_model(_small(0), tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo never",))


def test_load_state_dict(tmp_path):
    from safetensors.torch import save_file

    _sharded(tmp_path)
    first = tmp_path / "model-00001-of-00002.safetensors"
    got = U.load_state_dict(str(first), device_map={"0": "cpu", "1": "disk"})
    assert sorted((k, t.device.type) for k, t in got.items()) == [
        ("0.bias", "cpu"),
        ("0.weight", "cpu"),
        ("count", "cpu"),
    ]
    save_file({"w": torch.ones(1)}, tmp_path / "tf.safetensors", metadata={"format": "tf"})
    with pytest.raises(ValueError, match="saved with tf"):
        U.load_state_dict(str(tmp_path / "tf.safetensors"))
    save_file({"w": torch.ones(1)}, tmp_path / "odd.safetensors", metadata={"format": "jax"})
    with pytest.raises(OSError, match="valid metadata"):
        U.load_state_dict(str(tmp_path / "odd.safetensors"))
    torch.save({"w": torch.ones(1), "x": _Evil()}, tmp_path / "evil.bin")
    with pytest.raises(UnsafeCheckpoint):
        U.load_state_dict(str(tmp_path / "evil.bin"))  # read with weights_only: nothing runs


# --------------------------------------------------------------------------- transformers and peft checks
def test_check_tied_parameters_in_config_and_is_peft_model(monkeypatch):
    assert U.check_tied_parameters_in_config(_net()) is False  # not a transformers model
    PreTrainedModel = type("PreTrainedModel", (nn.Module,), {})  # noqa: N806

    class Config:
        tie_word_embeddings = True

    class Tied(PreTrainedModel):
        def __init__(self) -> None:
            super().__init__()
            self.config = Config()
            self.out = nn.Linear(2, 2)

        def get_output_embeddings(self) -> nn.Module:
            return self.out

    assert U.check_tied_parameters_in_config(Tied()) is True
    Config.tie_word_embeddings = False
    assert U.check_tied_parameters_in_config(Tied()) is False
    assert U.is_peft_model(_net()) is False  # peft is not installed
    monkeypatch.setattr(I, "is_peft_available", lambda: True)
    peft = types.ModuleType("peft")
    peft.__spec__ = ModuleSpec("peft", None)
    peft.PeftModel = type("PeftModel", (nn.Module,), {})
    monkeypatch.setitem(sys.modules, "peft", peft)
    assert U.is_peft_model(peft.PeftModel()) and not U.is_peft_model(_net())


def test_ensure_weights_retied():
    model = _net()
    model._tied_weights_keys = ["head.weight"]

    def reinit(module: nn.Module) -> nn.Module:  # allocates new parameters, as to_empty would
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.zeros_like(p)))
        return module

    init = U.ensure_weights_retied(reinit, model, torch.device("cpu"))
    assert init is not reinit
    init(model.embed)
    init(model.head)
    assert model.head.weight is model.embed.weight
    assert U.ensure_weights_retied(reinit, nn.Linear(2, 2), torch.device("cpu")) is reinit


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_compile_regions_in_place():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 4)
    expected = model(x)
    assert U.compile_regions_fsdp2(model, backend="eager") is model
    compiled = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == ["inp", "blocks.0", "blocks.1", "out"]  # Accelerate's: each block, each part beside
    assert torch.allclose(model(x), expected)
    other = Stack()
    assert U.compile_regions_deepspeed(other, backend="eager") is None
    assert getattr(other.blocks[1], "_compiled_call_impl", None) is not None


# --------------------------------------------------------------------------- fp8
def test_ao_conversion_and_filter():
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    expected = model(x)
    assert U.has_ao_layers(model) is False
    U.convert_model_to_fp8_ao(model)
    assert [type(m).__name__ for m in model] == ["Linear", "Float8Linear", "Linear"]  # first and last kept
    assert U.has_ao_layers(model) is True
    assert torch.allclose(model(x), expected, atol=0.1)  # fp8 numbers (Accelerate's equal these to 1e-7)
    # Accelerate's filter, called on each layer: it compares the layer's own first/last names
    assert U.filter_first_and_last_linear_layers(nn.Linear(16, 32), "0") is True
    assert U.filter_first_and_last_linear_layers(nn.Linear(10, 32), "1") is False
    every = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    U.convert_model_to_fp8_ao(every, module_filter_func=U.filter_first_and_last_linear_layers)
    assert [type(m).__name__ for m in every] == ["Float8Linear", "Float8Linear"]


def test_torchao_required_and_deepspeed_required(monkeypatch):
    @U.torchao_required
    def needs_ao(a: int) -> int:
        return a + 1

    assert needs_ao.__name__ == "needs_ao"
    monkeypatch.setattr(I, "is_torchao_available", lambda: False)
    with pytest.raises(ImportError, match="needs torchao"):
        needs_ao(1)
    with pytest.raises(ImportError, match="needs torchao"):
        U.has_ao_layers(nn.Linear(2, 2))

    @U.deepspeed_required
    def needs_ds() -> str:
        return "ran"

    import hasten.distributed.state as state

    monkeypatch.setattr(state, "current_run", lambda: None)
    assert needs_ds() == "ran"  # before any Accelerator, as in Accelerate
    monkeypatch.setattr(state, "current_run", lambda: object())
    with pytest.raises(ValueError, match="does not run DeepSpeed.*FSDP2"):
        needs_ds()


def _fake_transformer_engine(monkeypatch) -> dict:
    """A stand-in ``transformer_engine`` package: its layers subclass torch's, its autocast and
    recipes record what they were given."""
    seen: dict = {"autocast": []}

    class Linear(nn.Linear):
        def __init__(self, i: int, o: int, bias: bool = True, params_dtype: torch.dtype | None = None) -> None:
            super().__init__(i, o, bias=bias, dtype=params_dtype)

    class LayerNorm(nn.LayerNorm):
        def __init__(self, n: int, eps: float = 1e-5, params_dtype: torch.dtype | None = None) -> None:
            super().__init__(n, eps=eps, dtype=params_dtype)

    class fp8_autocast:  # noqa: N801 - TransformerEngine's name
        def __init__(self, enabled: bool, fp8_recipe: object) -> None:
            seen["autocast"].append((enabled, fp8_recipe))

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    class DelayedScaling:
        def __init__(self, **kwargs: object) -> None:
            self.kwargs = kwargs

    modules = {}
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
                 "transformer_engine.common.recipe"):  # fmt: skip
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, modules[name])
    te = modules["transformer_engine.pytorch"]
    te.Linear, te.LayerNorm, te.fp8_autocast = Linear, LayerNorm, fp8_autocast
    recipe = modules["transformer_engine.common.recipe"]
    recipe.DelayedScaling = DelayedScaling
    recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3", E5M2="E5M2")
    modules["transformer_engine"].pytorch = te
    modules["transformer_engine"].common = modules["transformer_engine.common"]
    modules["transformer_engine.common"].recipe = recipe
    return seen


def test_transformer_engine_helpers(monkeypatch):
    from hasten import TERecipeKwargs

    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(10, 16))
    calls = (
        lambda: U.convert_model(model),
        lambda: U.has_transformer_engine_layers(model),
        lambda: U.contextual_fp8_autocast(model.forward, None),
        lambda: U.apply_fp8_autowrap(model, None),
    )
    for call in calls:
        with pytest.raises(ImportError, match="requires transformer_engine"):
            call()
    seen = _fake_transformer_engine(monkeypatch)
    monkeypatch.setattr(I, "is_transformer_engine_available", lambda: True)
    te = sys.modules["transformer_engine.pytorch"]
    before = [m.weight.detach().clone() for m in model]
    U.convert_model(model)
    assert [type(m) for m in model] == [te.Linear, te.LayerNorm, nn.Linear]  # 10 is not a multiple of 16
    assert all(torch.equal(m.weight, w) for m, w in zip(model, before))
    assert U.has_transformer_engine_layers(model)
    U.convert_model(model, to_transformer_engine=False)
    assert [type(m) for m in model] == [nn.Linear, nn.LayerNorm, nn.Linear]
    assert not U.has_transformer_engine_layers(model)
    assert all(torch.equal(m.weight, w) for m, w in zip(model, before))

    small, x = nn.Linear(16, 16), torch.randn(2, 16)
    expected = small(x)
    assert U.apply_fp8_autowrap(small, TERecipeKwargs(fp8_format="E4M3")) is small
    assert torch.equal(small(x), expected) and hasattr(small.forward, "__wrapped__")
    small.eval()
    small(x)
    (training, recipe), (evaluating, _) = seen["autocast"]
    assert (training, evaluating) == (True, False)  # fp8 off in evaluation unless use_autocast_during_eval
    assert recipe.kwargs == {"fp8_format": "E4M3"}  # the handler's non-default fields, as Accelerate passes them
    forward = U.contextual_fp8_autocast(lambda a: a * 2, "recipe", use_during_eval=True)
    assert forward(small, 3) == 6 and seen["autocast"][-1] == (True, "recipe")


def test_check_cuda_fp8_capability_and_gpu_info(monkeypatch):
    answers = {"compute_capability": "8.9\n8.0", "count,name": "2, NVIDIA H100 80GB\n2, NVIDIA H100 80GB"}

    def smi(cmd: list[str], universal_newlines: bool = True) -> str:
        assert cmd[0] == "nvidia-smi"
        return answers[cmd[1].split("=")[1]]

    monkeypatch.setattr(E.subprocess, "check_output", smi)
    assert U.check_cuda_fp8_capability() is True  # the first GPU's
    answers["compute_capability"] = "8.0"
    assert U.check_cuda_fp8_capability() is False
    assert U.get_gpu_info() == (["NVIDIA H100 80GB", "NVIDIA H100 80GB"], 2)

    def missing(*args: object, **kwargs: object) -> str:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(E.subprocess, "check_output", missing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert U.check_cuda_fp8_capability() is True  # torch answers where nvidia-smi cannot
    with pytest.raises(FileNotFoundError):
        U.get_gpu_info()


def test_machine_facts(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    assert U.get_cpu_distributed_information() == E.CPUInformation(0, 1, 0, 1)
    for name, value in (("PMI_RANK", "3"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")):
        monkeypatch.setenv(name, value)
    info = U.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert U.get_current_device_type() == ("cuda", "MULTI_GPU")  # Accelerate's answer without another device
    monkeypatch.setattr(I, "is_xpu_available", lambda check_device=False: True)
    assert U.get_current_device_type() == ("xpu", "MULTI_XPU")


# --------------------------------------------------------------------------- launching, plugins, collectives
def test_prepare_for_launch(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "FORK_LAUNCHED"):
        monkeypatch.setenv(name, "unset")
    monkeypatch.setenv("NPROC", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    calls = []
    U.PrepareForLaunch(lambda *a: calls.append((a, os.environ["RANK"], os.environ["LOCAL_RANK"])), "MULTI_CPU")(1, "x")
    assert calls == [(("x",), "3", "1")] and os.environ["FORK_LAUNCHED"] == "1"
    monkeypatch.setenv("RANK", "unset")
    U.PrepareForLaunch(lambda: calls.append(os.environ["RANK"]))(0)
    assert calls[-1] == "unset"  # distributed_type "NO": the ranks are left alone
    with pytest.raises(ValueError):
        U.PrepareForLaunch(print, "NOT_A_TYPE")
    for refused in (U.prepare_multi_gpu_env, U.prepare_simple_launcher_cmd_env):
        with pytest.raises(NotImplementedError, match="hasten launch"):
            refused(types.SimpleNamespace())


def test_torch_tensor_parallel_plugin_is_refused_where_used():
    plugin = U.TorchTensorParallelPlugin()
    assert (plugin.tp_size, plugin.torch_device_mesh) == (1, None)
    with pytest.raises(TypeError, match=r"ParallelismConfig\(tp_size"):
        Accelerator(cpu=True, torch_tp_plugin=U.TorchTensorParallelPlugin(tp_size=2))


def test_one_process_collectives_and_gathered_parameters():
    p = nn.Parameter(torch.ones(2))
    with U.GatheredParameters([p], modifier_rank=0):
        p.data.add_(1)  # nothing gathered, nothing scattered: the parameter as it is
    assert torch.equal(p, torch.full((2,), 2.0))
    assert torch.equal(U.copy_tensor_to_devices(torch.arange(3.0)), torch.arange(3.0))
    with pytest.raises(ValueError, match="every process passed None"):
        U.copy_tensor_to_devices(None)
    losses = U.avg_losses_across_data_parallel_group([torch.tensor(2.0), torch.tensor([3.0])])
    assert losses.tolist() == [2.0, 3.0]


def test_ram_efficient_loading_and_grad_scaler(monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.setenv(name, "recorded")  # so that the variables are restored (unset) after the test
        monkeypatch.delenv(name)
    U.enable_fsdp_ram_efficient_loading()
    assert (os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]) == ("True", "True")
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is True
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    U.enable_fsdp_ram_efficient_loading()
    assert os.environ["ACCELERATE_USE_FSDP"] == "false"  # the user's value kept
    U.disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"
    assert FullyShardedDataParallelPlugin().cpu_ram_efficient_loading is False
    scaler = U.get_fsdp2_grad_scaler(init_scale=1024.0, growth_interval=5)
    assert type(scaler) is torch.amp.GradScaler and scaler.is_enabled()
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 5)


def test_fsdp2_switch_optimizer_parameters():
    model = nn.Linear(2, 2)
    old = list(model.parameters())
    new = [nn.Parameter(p.detach() * 2) for p in old]
    for key in (lambda p: p, lambda p: p.data_ptr()):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        U.fsdp2_switch_optimizer_parameters(opt, {key(p): q for p, q in zip(old, new)})
        assert opt.param_groups[0]["params"] == new
    # Accelerate's prepare: placeholders whose data_ptr attribute holds the old address
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, p in enumerate(opt.param_groups[0]["params"]):
        placeholder = torch.empty(1)
        placeholder.data_ptr = p.data_ptr()
        opt.param_groups[0]["params"][i] = placeholder
    U.fsdp2_switch_optimizer_parameters(opt, {p.data_ptr(): q for p, q in zip(old, new)})
    assert opt.param_groups[0]["params"] == new
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyError, match="couldn't be switched"):
        U.fsdp2_switch_optimizer_parameters(opt, {old[0]: new[0]})
    assert opt.param_groups[0]["params"] == old  # nothing changed


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block.fc(block.norm(x))
        return self.out(x)


def test_fsdp2_helpers_on_one_process():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain = Accelerator(cpu=True)
    for call in (U.fsdp2_prepare_model, U.fsdp2_apply_ac, U.fsdp2_load_full_state_dict):
        with pytest.raises(ValueError, match="does not shard with FSDP"):
            call(plain, Tower(), *([{}] if call is U.fsdp2_load_full_state_dict else []))
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(3, 4)
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert U.fsdp2_apply_ac(acc, model) is model
    assert [type(b) for b in model.blocks] == [CheckpointWrapper, CheckpointWrapper]
    assert type(model.inp) is nn.Linear
    got = model(x)
    got.sum().backward()
    assert torch.allclose(got, expected) and all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), grads))
    prepared = U.fsdp2_prepare_model(acc, Tower())  # one process: nothing to shard over, placed as prepare does
    assert isinstance(prepared, nn.Module) and not U.model_has_dtensor(prepared)
    source = Tower().state_dict()
    assert U.fsdp2_load_full_state_dict(acc, prepared, source) is prepared and _equal(prepared, source)
    with pytest.raises(KeyError, match="missing from full state dict"):
        U.fsdp2_load_full_state_dict(acc, prepared, {k: t for k, t in source.items() if k != "out.bias"})


def test_fsdp2_and_collectives_on_two_processes(tmp_path):
    proc = launch("--num_processes", "2", "--main_process_port", free_port(), SCRIPTS / "utils5_fsdp.py", tmp_path,
                  timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(ranks):
        assert got["prepare"] == {
            "root_fsdp": True, "blocks_fsdp": [True, True], "dtensor": True, "forward": True, "again_is_same": True
        }  # fmt: skip
        assert got["load_full"] and got["unchanged_after_missing"] and got["load_full_meta"]
        assert got["missing"] == ("KeyError" if rank == 0 else "RuntimeError")  # raised everywhere, no hang
        assert got["checkpoint_in_model"] and got["checkpoint_broadcast"]
        assert got["copied"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and got["copied_dtype"] == "torch.float32"
        assert got["avg_losses"] == [1.5, 15.0]
