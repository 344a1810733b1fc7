"""FullyShardedDataParallelPlugin validation and environment defaults, and FSDP at one process
(no processes started)."""

from __future__ import annotations

import pytest
import torch
from fsdp_common import make_model

import hasten
import hasten.utils
from hasten import Accelerator, DistributedType, FullyShardedDataParallelPlugin
from hasten.settings.environment import FSDP_FIELDS as ENV_FSDP
from hasten.training.precision import Precision


def _fsdp_policy(plugin: FullyShardedDataParallelPlugin, mixed_precision: str):
    """FSDP's MixedPrecisionPolicy with ``plugin`` under ``Accelerator(mixed_precision=...)``."""
    return Precision(mixed_precision, torch.device("cpu")).fsdp_mixed_precision(plugin.given_mixed_precision())


@pytest.fixture(autouse=True)
def _no_fsdp_env(monkeypatch):
    for name in (*ENV_FSDP.values(), "ACCELERATE_USE_FSDP", "HASTEN_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)


def test_importable_like_accelerate():
    assert hasten.utils.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert DistributedType.FSDP == "FSDP"


def test_defaults():
    p = FullyShardedDataParallelPlugin()
    assert (p.fsdp_version, p.reshard_after_forward, p.cpu_offload) == (2, True, False)
    assert (p.auto_wrap_policy, p.state_dict_type, p.activation_checkpointing) == (
        "no_wrap",
        "SHARDED_STATE_DICT",
        False,
    )
    p = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="Block, Layer", state_dict_type="full_state_dict")
    assert p.auto_wrap_policy == "transformer_based_wrap" and p.transformer_cls_names_to_wrap == ["Block", "Layer"]
    assert p.state_dict_type == "FULL_STATE_DICT"
    assert FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP").min_num_params == 100_000_000


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"fsdp_version": 1},
            ValueError,
            r"fsdp_version=1: hasten implements FSDP2 only.*FULL_SHARD/SHARD_GRAD_OP -> reshard_after_forward",
        ),
        ({"fsdp_version": 3}, ValueError, r"fsdp_version must be 2, got 3"),
        (
            {"sharding_strategy": "FULLSHARD"},
            ValueError,
            r"sharding_strategy must be one of 'FULL_SHARD', .* got 'FULLSHARD'",
        ),
        ({"backward_prefetch": "BACKWARD_PRE"}, ValueError, r"backward_prefetch='BACKWARD_PRE' is an FSDP1 field"),
        ({"forward_prefetch": True}, ValueError, r"forward_prefetch=True is an FSDP1 field"),
        ({"use_orig_params": True}, ValueError, r"use_orig_params=True is an FSDP1 field"),
        ({"sync_module_states": True}, ValueError, r"sync_module_states=True is an FSDP1 field"),
        ({"limit_all_gathers": True}, ValueError, r"limit_all_gathers=True is an FSDP1 field"),
        (
            {"auto_wrap_policy": "layer_wrap"},
            ValueError,
            r"auto_wrap_policy must be one of 'transformer_based_wrap', 'size_based_wrap', 'no_wrap', got 'layer_wrap'",
        ),
        ({"auto_wrap_policy": 3}, TypeError, r"auto_wrap_policy must be one of .* or a callable"),
        (
            {"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": True},
            ValueError,
            r"sharding_strategy='SHARD_GRAD_OP' means reshard_after_forward=False, but reshard_after_forward=True",
        ),
        (
            {"transformer_cls_names_to_wrap": [1]},
            TypeError,
            r"transformer_cls_names_to_wrap must be a list of class names",
        ),
        ({"reshard_after_forward": 0}, ValueError, r"reshard_after_forward must be True, False or an integer >= 1"),
        ({"reshard_after_forward": "yes"}, ValueError, r"reshard_after_forward must be True, False or an integer"),
        (
            {"cpu_offload": "yes"},
            TypeError,
            r"cpu_offload must be True, False or a torch.distributed.fsdp.CPUOffloadPolicy",
        ),
        (
            {"mixed_precision_policy": {"param_dtype": "int8"}},
            ValueError,
            r"mixed_precision_policy\['param_dtype'\] must be a torch dtype",
        ),
        ({"mixed_precision_policy": {"dtype": "bf16"}}, ValueError, r"unknown keys \['dtype'\]"),
        (
            {"mixed_precision_policy": "int8"},
            ValueError,
            r"mixed_precision_policy must be a MixedPrecisionPolicy, a dict of its fields, one of 'fp32'.*got 'int8'",
        ),
        ({"mixed_precision_policy": 3}, TypeError, r"must be a torch.distributed.fsdp.MixedPrecisionPolicy, a dict"),
        (
            {"activation_checkpointing_offload": "yes"},
            TypeError,
            r"activation_checkpointing_offload must be True or False",
        ),
        (
            {"activation_checkpointing_offload": True},
            ValueError,
            r"activation_checkpointing_offload=True offloads the inputs .* set activation_checkpointing=True too",
        ),
        (
            {"state_dict_config": {"offload_to_cpu": True}},
            TypeError,
            r"state_dict_config must be None or a torch.distributed.fsdp.ShardedStateDictConfig "
            r"\(state_dict_type='SHARDED_STATE_DICT'\)",
        ),
        (
            {"optim_state_dict_config": "full"},
            TypeError,
            r"optim_state_dict_config must be None or a torch.distributed.fsdp.ShardedOptimStateDictConfig",
        ),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, ValueError, r"'LOCAL_STATE_DICT' is FSDP1's"),
        (
            {"state_dict_type": "sharded"},
            ValueError,
            r"state_dict_type must be one of 'SHARDED_STATE_DICT', 'FULL_STATE_DICT'",
        ),
        (
            {"activation_checkpointing": "yes"},
            ValueError,
            r"activation_checkpointing must be one of .full., .selective.",
        ),
        ({"activation_checkpointing": 1}, TypeError, r"activation_checkpointing must be True or False, one of"),
        ({"min_num_params": 0}, ValueError, r"min_num_params must be >= 1"),
        (
            {"ignored_modules": [3]},
            TypeError,
            r"ignored_modules must be a list of torch.nn.Module or a regular expression",
        ),
        ({"ignored_modules": "("}, ValueError, r"ignored_modules='\(' is not a regular expression"),
        (
            {"param_init_fn": 3},
            TypeError,
            r"FullyShardedDataParallelPlugin.param_init_fn must be a callable or None, got 3",
        ),
    ],
)
def test_bad_fields_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


def test_accelerate_fields_accepted_as_accelerate_writes_them():
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        MixedPrecisionPolicy,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    p = FullyShardedDataParallelPlugin(state_dict_config=None, optim_state_dict_config=None)
    assert p.state_dict_config is None and p.optim_state_dict_config is None
    FullyShardedDataParallelPlugin(
        state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),
    )
    full = {"state_dict_type": "FULL_STATE_DICT"}
    FullyShardedDataParallelPlugin(
        **full,
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    # Any full config is taken (and honoured where full state dicts are gathered: tests/test_dropin_round4_optim.py).
    taken = FullyShardedDataParallelPlugin(**full, state_dict_config=FullStateDictConfig())
    assert taken.full_gather() == (False, False)
    with pytest.raises(
        TypeError, match=r"state_dict_config must be None or a torch.distributed.fsdp.FullStateDictConfig"
    ):
        FullyShardedDataParallelPlugin(**full, state_dict_config=ShardedStateDictConfig())
    # Accelerate's string policy: parameters gathered and gradients reduced in that dtype.
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("FP32", torch.float32)):
        p = FullyShardedDataParallelPlugin(mixed_precision_policy=name)
        assert _fsdp_policy(p, "no") == MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        assert _fsdp_policy(p, "bf16") == MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)  # given wins
    p = FullyShardedDataParallelPlugin(activation_checkpointing=True, activation_checkpointing_offload=True)
    assert p.activation_checkpointing_offload is True


def test_activation_checkpointing_offload_keeps_the_block_inputs_on_the_cpu_with_the_same_gradients(monkeypatch):
    import copy

    import torch.autograd.graph as graph
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    packed: list[tuple[tuple[int, ...], bool]] = []
    original = graph.save_on_cpu

    class Recording(graph.saved_tensors_hooks):  # save_on_cpu, noting what it packs
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            inner = original(pin_memory, device_type)

            def pack(t):
                packed.append((tuple(t.shape), pin_memory))
                return inner.pack_hook(t)

            super().__init__(pack, inner.unpack_hook)

    monkeypatch.setattr(graph, "save_on_cpu", Recording)
    x, y = torch.randn(5, 8), torch.randint(0, 6, (5,))
    grads = {}
    for offload in (None, False, True):  # no checkpointing, checkpointing, checkpointing with the offload
        model = make_model()
        if offload is None:
            reference = copy.deepcopy(model)
            torch.nn.functional.cross_entropy(reference(x), y).backward()
            grads[offload] = [p.grad for p in reference.parameters()]
            continue
        plugin = FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=["Block"],
            activation_checkpointing=True,
            activation_checkpointing_offload=offload,
        )
        acc = Accelerator(cpu=True, fsdp_plugin=plugin)
        model = acc.prepare(model)
        assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper"] * 2
        assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
        packed.clear()
        acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        grads[offload] = [p.grad for p in model.parameters()]
        if offload:
            # Each block's input (5 x 12) waited for backward through save_on_cpu, unpinned on the CPU.
            assert packed.count(((5, 12), False)) >= 2, packed
        else:
            assert packed == []
        # The model's own parameter names, as without the wrapper.
        assert "blocks.0.up.weight" in model.state_dict()
    for offload in (False, True):
        for got, want in zip(grads[offload], grads[None]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_mixed_precision_policy_from_the_accelerator_or_given():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = FullyShardedDataParallelPlugin()
    assert _fsdp_policy(p, "bf16") == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert _fsdp_policy(p, "no") == MixedPrecisionPolicy()
    given = FullyShardedDataParallelPlugin(
        mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": torch.bfloat16}
    )
    assert _fsdp_policy(given, "no") == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def test_accelerate_environment_variables_fill_the_defaults(monkeypatch):
    env = {
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Head",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
        "FSDP_ACTIVATION_CHECKPOINTING": "1",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_MIN_NUM_PARAMS": "1000",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true",
    }
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    p = FullyShardedDataParallelPlugin()
    assert p.reshard_after_forward is False and p.cpu_offload is True
    assert p.auto_wrap_policy == "transformer_based_wrap" and p.transformer_cls_names_to_wrap == ["Block", "Head"]
    assert p.state_dict_type == "FULL_STATE_DICT" and p.activation_checkpointing and p.cpu_ram_efficient_loading
    assert p.min_num_params == 1000 and p.activation_checkpointing_offload is True
    assert FullyShardedDataParallelPlugin(cpu_offload=False).cpu_offload is False  # code wins
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="hasten implements FSDP2 only"):
        FullyShardedDataParallelPlugin()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "maybe")
    with pytest.raises(
        ValueError,
        match=(
            r"environment variable FSDP_OFFLOAD_PARAMS must be one of 1/0, true/false, yes/no, on/off \(in any case\), "
            r"got 'maybe'"
        ),
    ):
        FullyShardedDataParallelPlugin()


@pytest.mark.parametrize("variable", ["HASTEN_USE_FSDP", "ACCELERATE_USE_FSDP"])
def test_accelerator_builds_the_plugin_when_the_launcher_asks(monkeypatch, variable):
    assert Accelerator(cpu=True).fsdp_plugin is None
    monkeypatch.setenv(variable, "true")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block")
    acc = Accelerator(cpu=True)
    assert acc.fsdp_plugin.transformer_cls_names_to_wrap == ["Block"]
    assert acc.distributed_type == DistributedType.FSDP and acc.strategy.name == "fsdp"


def test_wrong_plugin_type_and_old_torch_are_refused():
    with pytest.raises(TypeError, match="Accelerator.fsdp_plugin must be a FullyShardedDataParallelPlugin or None"):
        Accelerator(cpu=True, fsdp_plugin={"fsdp_version": 2})
    from hasten.strategies.fsdp import check_torch_version

    with pytest.raises(RuntimeError, match=r"needs torch >= 2.11, found 2.10.1.*pytorch/pytorch#162338"):
        check_torch_version("2.10.1+cpu")
    check_torch_version("2.11.0")
    check_torch_version("3.0.0a0")


def test_one_process_checks_the_wrap_policy_and_saves_the_sharded_layout(tmp_path):
    import json

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Decoder"]))
    with pytest.raises(ValueError, match=r"names \['Decoder'\], which the model \(TinyNet\) does not contain"):
        acc.prepare(make_model())
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    assert type(model).__name__ == "TinyNet"  # one process: nothing to shard over
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    acc.save_state(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "hasten_checkpoint.json").read_text())
    assert manifest["layout"] == "dcp" and manifest["models"][0]["dir"] == "model_0"
    assert any(f.startswith("model_0/") and f.endswith(".distcp") for f in manifest["files"])
    saved = {k: t.clone() for k, t in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(tmp_path / "ck")
    for k, t in saved.items():
        torch.testing.assert_close(model.state_dict()[k], t, rtol=0, atol=0)


def test_config_file_fsdp_section(tmp_path):
    import hasten.settings.config_file as hasten_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "fsdp:\n  version: 2\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  transformer_layer_cls_to_wrap: [Block, Layer]\n  offload_params: false\n  reshard_after_forward: 4\n"
    )
    launch = hasten_config.load_config(path).launch
    assert launch == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "transformer_based_wrap",
        "fsdp_transformer_layer_cls_to_wrap": "Block,Layer",
        "fsdp_offload_params": "false",
        "fsdp_reshard_after_forward": "4",
        "use_fsdp": True,
    }
    path.write_text("fsdp_config:\n  fsdp_state_dict_type: full_state_dict\nuse_fsdp: false\n")  # Accelerate's spelling
    assert hasten_config.load_config(path).launch == {"fsdp_state_dict_type": "FULL_STATE_DICT", "use_fsdp": False}
    path.write_text("fsdp:\n  sharding_strategy: FULL_SHARD\n")  # FSDP1's, mapped by hasten launch (issue 53)
    assert hasten_config.load_config(path).launch["fsdp_sharding_strategy"] == "FULL_SHARD"
    path.write_text("fsdp:\n  limit_all_gathers: true\n")
    with pytest.raises(ValueError, match="unknown key 'limit_all_gathers'"):
        hasten_config.load_config(path)
    path.write_text("fsdp:\n  offload_params: perhaps\n")
    with pytest.raises(ValueError, match="fsdp_offload_params must be one of"):
        hasten_config.load_config(path)
