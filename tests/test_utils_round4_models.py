"""Issue 41, second half of the missing ``accelerate.utils`` names: the FSDP checkpoint functions
(``hasten.utils.fsdp_utils``), the model helpers (``hasten.utils.modeling``), the DeepSpeed
classes (``hasten.utils.deepspeed``, refused where used) and ``ParallelismConfig``'s Accelerate
fields. One process here; the sharded save/load/merge on 2 processes in scripts/utils4_fsdp.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types

import pytest
import torch

from hasten import Accelerator, AutocastKwargs, DistributedType, FullyShardedDataParallelPlugin
from hasten.settings.parallelism import DeepSpeedSequenceParallelConfig, ParallelismConfig
from hasten.utils.deepspeed import DeepSpeedPlugin
from hasten.utils.deepspeed import DeepSpeedSequenceParallelConfig as ReExported
from hasten.utils.fsdp_utils import (
    load_fsdp_model,
    load_fsdp_optimizer,
    merge_fsdp_weights,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from hasten.utils.modeling import (
    compile_regions,
    extract_model_from_parallel,
    get_grad_scaler,
    get_mixed_precision_context_manager,
    has_compiled_regions,
    is_compiled_module,
    model_has_dtensor,
)
from launch_utils import SCRIPTS, free_port, launch


class Block(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


# --------------------------------------------------------------------------- ParallelismConfig
def test_parallelism_config_takes_accelerates_fields_with_its_defaults():
    config = ParallelismConfig()
    assert (config.cp_backend, config.sp_size, config.sp_backend, config.sp_handler) == ("torch", 1, "torch", None)
    handler = DeepSpeedSequenceParallelConfig()
    given = ParallelismConfig(cp_backend="torch", sp_size=1, sp_backend="deepspeed", sp_handler=handler)
    assert given.sp_handler is handler and handler.sp_seq_length_is_variable is True
    # added after the existing fields: positional use is unchanged
    positional = ParallelismConfig(1, 1, 1, 1)
    assert (positional.dp_replicate_size, positional.cp_size, positional.tp_handler) == (1, 1, None)
    assert ReExported is DeepSpeedSequenceParallelConfig


def test_parallelism_config_reads_the_launchers_cp_backend(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_BACKEND", "deepspeed")
    with pytest.raises(ValueError, match=r"cp_backend='deepspeed' .*allowed: 'torch'"):
        ParallelismConfig()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"sp_size": 2, "sp_backend": "deepspeed"},
            ValueError,
            r"sp_size=2, sp_backend='deepspeed'.*does not run DeepSpeed.*sp_backend='torch'",
        ),
        ({"sp_size": 0}, ValueError, r"ParallelismConfig.sp_size must be >= 1, got 0"),
        ({"sp_size": "2"}, TypeError, r"ParallelismConfig.sp_size must be an integer"),
        ({"cp_backend": "deepspeed"}, ValueError, r"ParallelismConfig.cp_backend='deepspeed' .*allowed: 'torch'"),
        ({"sp_backend": "ulysses"}, ValueError, r"sp_backend='ulysses' .*allowed: 'torch', 'deepspeed'"),
        ({"sp_handler": {"sp_seq_length": 8}}, TypeError, r"sp_handler must be a DeepSpeedSequenceParallelConfig"),
    ],
)
def test_parallelism_config_refuses_what_hasten_cannot_run(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelismConfig(**kwargs)


def test_sequence_parallel_config_is_checked_as_accelerates():
    assert DeepSpeedSequenceParallelConfig(sp_seq_length=128, sp_attn_implementation="sdpa").sp_seq_length == 128
    assert DeepSpeedSequenceParallelConfig(sp_attn_implementation="kernels-community/flash-attn2")
    with pytest.raises(ValueError, match="needs sp_seq_length"):
        DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False)
    with pytest.raises(ValueError, match=r"sp_attn_implementation='eager' is not supported.*'sdpa'"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")


# --------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_plugin_builds_and_its_use_is_refused():
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0)
    assert (plugin.zero_stage, plugin.is_train_batch_min, plugin.offload_param_device) == (3, True, None)
    assert repr(plugin) == "DeepSpeedPlugin(gradient_clipping=1.0, zero_stage=3)"
    with pytest.raises(
        TypeError,
        match=r"deepspeed_plugin=DeepSpeedPlugin\(gradient_clipping=1.0, zero_stage=3\)\) .*DeepSpeed.*fsdp_plugin=",
    ):
        Accelerator(deepspeed_plugin=plugin)
    with pytest.raises(TypeError, match=r"deepspeed_plugins=.*DeepSpeed"):
        Accelerator(deepspeed_plugins={"a": plugin})
    with pytest.raises(NotImplementedError, match=r"zero3_init_context_manager\(\) needs DeepSpeed.*FSDP2"):
        plugin.zero3_init_context_manager(enable=True)


# --------------------------------------------------------------------------- compiled modules
def test_compile_regions_compiles_each_block_and_leaves_the_model():
    model = _net()
    x = torch.randn(5, 4)
    expected = model(x)
    assert not has_compiled_regions(model) and not is_compiled_module(model)
    compiled = compile_regions(model, backend="eager")
    assert compiled is not model and compiled.__dict__["_orig_mod"] is model
    assert all(is_compiled_module(b) for b in compiled.layers)
    assert is_compiled_module(compiled.head) and is_compiled_module(compiled.embed)  # the rest, on its own
    assert not any(is_compiled_module(b) for b in model.layers)  # the original is as it was
    assert has_compiled_regions(compiled) and not is_compiled_module(compiled)
    torch.testing.assert_close(compiled(x), expected)
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    whole = compile_regions(torch.nn.Linear(4, 4), backend="aot_eager")  # no repeated blocks: the whole
    assert is_compiled_module(whole)


def test_has_compiled_regions_sees_in_place_compilation():
    model = _net()
    model.layers[0].compile(backend="aot_eager")  # what a prepared model's regional compilation does
    assert has_compiled_regions(model) and not is_compiled_module(model)


def test_extract_model_from_parallel_unwraps_containers():
    model = _net()
    compiled = torch.compile(torch.nn.DataParallel(model), backend="aot_eager")
    kept = extract_model_from_parallel(compiled)
    assert is_compiled_module(kept) and kept._orig_mod is model
    assert compiled._orig_mod.module is model  # the original wrapper is left as it is
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    outer = torch.nn.Sequential(torch.nn.DataParallel(model))
    assert extract_model_from_parallel(outer) is outer and isinstance(outer[0], torch.nn.DataParallel)
    assert extract_model_from_parallel(outer, recursive=True) is outer and outer[0] is model
    with pytest.raises(TypeError, match="recursive must be True or False"):
        extract_model_from_parallel(model, recursive="yes")


def test_extract_model_from_parallel_removes_the_autocast_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_net())
    assert "forward" in model.__dict__  # the autocast forward
    assert extract_model_from_parallel(model) is model and "forward" in model.__dict__
    assert extract_model_from_parallel(model, keep_fp32_wrapper=False) is model
    assert "forward" not in model.__dict__
    assert not model_has_dtensor(model)


# --------------------------------------------------------------------------- precision
@pytest.mark.filterwarnings("ignore:mixed_precision='fp16' on the CPU")
@pytest.mark.parametrize(("mixed_precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_context_manager_follows_the_run(mixed_precision, dtype):
    Accelerator(mixed_precision=mixed_precision)
    with get_mixed_precision_context_manager(native_amp=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    with get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with get_mixed_precision_context_manager():
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(TypeError, match="autocast_kwargs must be an AutocastKwargs or None"):
        get_mixed_precision_context_manager(True, {"enabled": False})


def test_get_grad_scaler():
    scaler = get_grad_scaler(init_scale=1024.0, growth_interval=10)
    assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == 1024.0 and scaler._growth_interval == 10
    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    assert scaler._device == (found.type if found else "cpu") and scaler.is_enabled()  # fp16 runs on the CPU too
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(get_grad_scaler(DistributedType.FSDP), ShardedGradScaler)
    assert not get_grad_scaler(enabled=False).is_enabled()
    with pytest.raises(TypeError, match=r"unexpected arguments \['scale'\]; allowed: init_scale"):
        get_grad_scaler(scale=2.0)
    with pytest.raises(ValueError, match="distributed_type must be a DistributedType or None, got 'ZERO'"):
        get_grad_scaler("ZERO")


def test_get_grad_scaler_follows_the_accelerator_that_is_there(monkeypatch, recwarn):
    # A CUDA build of torch on a machine without a GPU (PyPI's torch on a CPU machine): torch names
    # cuda as its accelerator but none is available; the scaler is the CPU one, enabled, as on the
    # CPU build (not a CUDA scaler that warns "CUDA is not available" and is disabled).
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    scaler = get_grad_scaler()
    assert scaler._device == "cpu" and scaler.is_enabled() and not recwarn.list
    # With the GPU there, the scaler is the GPU's (here only its device is checked: without one,
    # torch's CUDA scaler disables itself with a warning).
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else contextlib.nullcontext():
        assert get_grad_scaler()._device == "cuda"


# --------------------------------------------------------------------------- FSDP checkpoints, one process
def _fsdp(state_dict_type: str = "SHARDED_STATE_DICT"):
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type))
    model = acc.prepare(_net())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    return acc, model, opt


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fsdp_functions_refuse_bad_arguments_and_change_nothing(tmp_path):
    acc, model, opt = _fsdp()
    plugin = acc.fsdp_plugin
    before = _weights(model)
    with pytest.raises(TypeError, match="fsdp_plugin must be a FullyShardedDataParallelPlugin"):
        save_fsdp_model(None, acc, model, tmp_path)
    with pytest.raises(ValueError, match="model_index must be an integer >= 0, got -1"):
        save_fsdp_model(plugin, acc, model, tmp_path, model_index=-1)
    with pytest.raises(FileNotFoundError, match="no torch.distributed.checkpoint folder at .*pytorch_model_fsdp_0"):
        load_fsdp_model(plugin, acc, model, tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="optimizer.bin"):
        load_fsdp_optimizer(
            FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT"), acc, opt, model, tmp_path
        )
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())
    assert not any(tmp_path.iterdir())
    plain = Accelerator()
    with pytest.raises(ValueError, match="does not shard with FSDP .*fsdp_plugin=FullyShardedDataParallelPlugin"):
        save_fsdp_model(plugin, plain, plain.prepare(_net()), tmp_path)


def test_fsdp_model_round_trip_and_accelerates_own_folder(tmp_path):
    acc, model, opt = _fsdp()
    saved, moments = _weights(model), [v.clone() for s in opt.optimizer.state.values() for v in s.values()]
    save_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path)
    save_fsdp_optimizer(acc.fsdp_plugin, acc, opt, model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["optimizer_0", "pytorch_model_fsdp_0"]
    acc.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    assert not torch.equal(_weights(model)["head.weight"], saved["head.weight"])
    load_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path / "pytorch_model_fsdp_0")  # the folder itself too
    load_fsdp_optimizer(acc.fsdp_plugin, acc, opt, model, tmp_path)
    assert all(torch.equal(saved[k], v) for k, v in _weights(model).items())
    now = [v for s in opt.optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(now, moments))
    # a folder as Accelerate writes it (torch's own writer, {"model": state dict}) loads too
    import torch.distributed.checkpoint as dcp

    other = _net(seed=3)
    dcp.save(
        {"model": other.state_dict()},
        storage_writer=dcp.FileSystemWriter(str(tmp_path / "acc" / "pytorch_model_fsdp_0")),
    )
    load_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path / "acc")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in _weights(model).items())


def test_adapter_only_saves_the_trainable_parameters(tmp_path, monkeypatch):
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT"))
    model = acc.prepare(_net())
    for p in [*model.embed.parameters(), *model.layers.parameters()]:
        p.requires_grad_(False)
    monkeypatch.setitem(sys.modules, "peft", types.SimpleNamespace(PeftModel=Net))  # as if it were a PEFT model
    save_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path, model_index=1, adapter_only=True)
    assert sorted(torch.load(tmp_path / "pytorch_model_fsdp_1.bin", weights_only=True)) == ["head.bias", "head.weight"]
    save_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path, model_index=1)  # without: everything
    assert len(torch.load(tmp_path / "pytorch_model_fsdp_1.bin", weights_only=True)) == len(model.state_dict())


def test_merge_fsdp_weights(tmp_path):
    acc, model, _ = _fsdp()
    save_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path / "ckpt")
    from safetensors.torch import load_file

    folder = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    merge_fsdp_weights(folder, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == sorted(model.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    merge_fsdp_weights(folder, tmp_path / "bin", safe_serialization=False, remove_checkpoint_dir=True)
    assert sorted(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)) == sorted(merged)
    assert not folder.exists()
    # a hasten save_state checkpoint: its model, as `hasten merge-weights`
    acc.save_state(tmp_path / "state")
    merge_fsdp_weights(tmp_path / "state", tmp_path / "from_state")
    assert sorted(load_file(tmp_path / "from_state" / "model.safetensors")) == sorted(merged)
    save_fsdp_model(acc.fsdp_plugin, acc, model, tmp_path / "again")
    with pytest.raises(ValueError, match=r"has no \.metadata.*pass '.*again/pytorch_model_fsdp_0' instead"):
        merge_fsdp_weights(tmp_path / "again", tmp_path / "out2")
    with pytest.raises(ValueError, match="is not a directory"):
        merge_fsdp_weights(tmp_path / "missing", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_fsdp_functions_on_two_processes(tmp_path):
    proc = launch("--num_processes", "2", "--main_process_port", free_port(), SCRIPTS / "utils4_fsdp.py", tmp_path,
                  timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected_files = {
        "full": ["optimizer.bin", "pytorch_model_fsdp.bin"],
        "dcp": ["optimizer_0", "pytorch_model_fsdp_0"],
        "per_rank": [
            "optimizer_0_rank0.bin",
            "optimizer_0_rank1.bin",
            "pytorch_model_fsdp_0_rank0.bin",
            "pytorch_model_fsdp_0_rank1.bin",
        ],
    }
    for got in ranks:
        assert got["has_dtensor"] and got["trains_after"]
        for case, files in expected_files.items():
            assert got[case] == {
                "files": files,
                "scrambled": True,
                "missing": [],
                "model_ok": True,
                "optimizer_ok": True,
            }, case
    assert ranks[0]["merged_ok"] and ranks[0]["full_file_ok"]


def test_extract_model_takes_off_a_forward_wrapped_by_hand():
    """Accelerate's convention: a model whose forward was wrapped by hand (``convert_outputs_to_fp32``)
    keeps ``_original_forward``; ``keep_fp32_wrapper=False`` restores it, so the model pickles
    (Accelerate's test_can_undo_convert_outputs)."""
    import pickle

    from hasten.utils.operations import convert_outputs_to_fp32

    model = torch.nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(model.forward)
    with pytest.raises(Exception):  # noqa: B017 - the local wrapper does not pickle
        pickle.dumps(model)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    restored = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(restored(torch.ones(1, 2)), model(torch.ones(1, 2)))
