"""Accelerate's module hooks (hasten.hooks, built in hasten.big_model): the hook mechanism, the
AlignDevicesHook's offload (weights on meta between forwards, read from a weights map for each
forward), CpuOffload, and the attach_* helpers; Accelerate's own test cases, on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from big_model_cases import ModelForTest
from hasten.hooks import (
    AlignDevicesHook,
    CpuOffload,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from hasten.utils.modeling import align_module_device, has_offloaded_params

META = torch.device("meta")
CPU = torch.device("cpu")


class PreForwardHook(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] + 1,) + args[1:], kwargs


class PostForwardHook(ModelHook):
    def post_forward(self, module, output):
        return output + 1


def test_add_and_remove_hooks():
    model = ModelForTest()
    hook = ModelHook()
    add_hook_to_module(model, hook)
    assert model._hf_hook is hook
    assert hasattr(model, "_old_forward")
    assert model.forward.__name__ == "forward"  # the wrapper looks like the forward it wraps
    assert list(__import__("inspect").signature(model.forward).parameters) == ["x"]
    remove_hook_from_module(model)
    assert not hasattr(model, "_hf_hook") and not hasattr(model, "_old_forward")


def test_append_chains_hooks():
    model = ModelForTest()
    first, second = ModelHook(), ModelHook()
    add_hook_to_module(model, first)
    add_hook_to_module(model, second, append=True)
    assert isinstance(model._hf_hook, SequentialHook)
    assert model._hf_hook.hooks == (first, second)
    remove_hook_from_module(model)
    assert not hasattr(model, "_hf_hook")


def test_pre_and_post_forward_hooks_run():
    model = ModelForTest().eval()
    x = torch.randn(2, 3)
    expected, expected_plus = model(x + 1), model(x) + 1
    add_hook_to_module(model, PreForwardHook())
    torch.testing.assert_close(model(x), expected)
    add_hook_to_module(model, PreForwardHook())  # replaces, does not chain
    torch.testing.assert_close(model(x), expected)
    add_hook_to_module(model, SequentialHook(PreForwardHook(), PreForwardHook()))
    torch.testing.assert_close(model(x), model._old_forward(x + 2))
    remove_hook_from_module(model)
    add_hook_to_module(model, PostForwardHook())
    torch.testing.assert_close(model(x), expected_plus)
    add_hook_to_module(model, PostForwardHook(), append=True)
    torch.testing.assert_close(model(x), expected_plus + 1)
    remove_hook_from_module(model)
    torch.testing.assert_close(model(x), expected_plus - 1)


def test_no_grad_in_hook():
    model = ModelForTest()
    x = torch.randn(2, 3)
    assert model(x).requires_grad
    hook = PostForwardHook()
    hook.no_grad = True
    add_hook_to_module(model, hook)
    assert not model(x).requires_grad


def test_align_devices_hook_as_cpu_offload():
    model = ModelForTest().eval()
    x = torch.randn(2, 3)
    expected = model(x)
    for buffers in (False, True):
        for sub in (model.linear1, model.batchnorm, model.linear2):
            add_hook_to_module(sub, AlignDevicesHook(execution_device="cpu", offload=True, offload_buffers=buffers))
        assert model.linear1.weight.device == META and model.batchnorm.weight.device == META
        assert model.batchnorm.running_mean.device == (META if buffers else CPU)
        torch.testing.assert_close(model(x), expected)
        assert model.linear2.weight.device == META  # dropped again after the forward
        assert has_offloaded_params(model.linear1) and not has_offloaded_params(model)
        for sub in (model.linear1, model.batchnorm, model.linear2):
            remove_hook_from_module(sub)
        assert model.linear1.weight.device == CPU and model.batchnorm.running_mean.device == CPU
        torch.testing.assert_close(model(x), expected)


def test_attach_align_device_hook_as_cpu_offload():
    model = ModelForTest().eval()
    x = torch.randn(2, 3)
    expected = model(x)
    for weights_map in (None, model.state_dict()):
        for buffers in (False, True):
            attach_align_device_hook(
                model, execution_device="cpu", offload=True, weights_map=weights_map, offload_buffers=buffers
            )
            assert model.linear1.weight.device == META and model.linear2.weight.device == META
            assert model.batchnorm.running_mean.device == (META if buffers else CPU)
            torch.testing.assert_close(model(x), expected)
            remove_hook_from_submodules(model)
            assert model.linear1.weight.device == CPU and model.batchnorm.weight.device == CPU
            torch.testing.assert_close(model(x), expected)


class Recording(nn.Linear):
    """A linear layer that notes where its weight is while its forward runs."""

    seen: list

    def forward(self, x):
        self.seen.append(self.weight.device)
        return super().forward(x)


def test_offloaded_weights_live_on_meta_between_forwards():
    model = nn.Sequential(Recording(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].seen = []
    x = torch.randn(3, 4)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=weights)
    assert all(p.device == META for p in model.parameters())
    torch.testing.assert_close(model(x), expected)
    torch.testing.assert_close(model(x), expected)
    assert model[0].seen == [CPU, CPU, CPU]  # present while it runs
    assert all(p.device == META for p in model.parameters())  # and dropped after


def test_preload_module_classes_loads_the_whole_module():
    model = ModelForTest().eval()
    x = torch.randn(2, 3)
    expected = model(x)
    attach_align_device_hook(model, execution_device="cpu", offload=True, preload_module_classes=["ModelForTest"])
    assert model._hf_hook.place_submodules and not hasattr(model.linear1, "_hf_hook")
    torch.testing.assert_close(model(x), expected)
    assert model.linear1.weight.device == META


def test_io_same_device_and_skip_keys():
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x, extra=None):
            return {"out": self.linear(x), "extra_device": extra.device}

    module = Takes()
    add_hook_to_module(module, AlignDevicesHook(execution_device="meta", skip_keys="extra", place_submodules=True))
    assert module.linear.weight.device == META  # moved once, at attach time (no offload)
    out = module(torch.randn(2, 3), extra=torch.zeros(1))
    assert out["extra_device"] == CPU  # skipped: left where it was
    assert out["out"].device == META  # run on the execution device
    remove_hook_from_module(module)
    module = Takes()
    hook = AlignDevicesHook(execution_device="cpu", io_same_device=True)
    add_hook_to_module(module, hook)
    module(torch.randn(2, 3), extra=torch.zeros(1))
    assert hook.input_device == CPU  # where the outputs are sent back to


def test_attach_execution_device_hook_and_blocks():
    model = ModelForTest()
    attach_execution_device_hook(model, "cpu")
    assert isinstance(model.linear1._hf_hook, AlignDevicesHook)
    assert model._hf_hook.execution_device == "cpu"
    remove_hook_from_submodules(model)
    model = ModelForTest().eval()
    x = torch.randn(2, 3)
    expected = model(x)
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": "cpu", "linear1": "cpu", "batchnorm": "cpu", "linear2": "cpu"},
        offload={"linear1": False, "batchnorm": True, "linear2": True},
        weights_map=model.state_dict(),
    )
    assert model.linear1.weight.device == CPU and model.linear2.weight.device == META
    assert model._hf_hook.io_same_device
    torch.testing.assert_close(model(x), expected)


def test_align_module_device():
    model = ModelForTest()
    attach_align_device_hook(model, execution_device="cpu", offload=True)
    with align_module_device(model.linear1):
        assert model.linear1.weight.device == CPU
    assert model.linear1.weight.device == META
    plain = nn.Linear(2, 2)
    with align_module_device(plain, "cpu"):
        assert plain.weight.device == CPU
    with align_module_device(model.linear2, "meta"):  # an offloaded module's hook, on another device
        assert model.linear2.weight.device == META and model.linear2._hf_hook.execution_device == "meta"
    assert model.linear2._hf_hook.execution_device == "cpu"


def test_cpu_offload_hook_moves_model_for_its_forward():
    model = ModelForTest().eval()
    model, user = __import__("hasten.big_modeling", fromlist=["x"]).cpu_offload_with_hook(
        model, execution_device="meta"
    )
    assert isinstance(user, UserCpuOffloadHook) and isinstance(model._hf_hook, CpuOffload)
    assert next(model.parameters()).device == CPU  # kept on the CPU until its forward
    assert model(torch.randn(2, 3)).device == META  # moved with its inputs for the forward
    assert next(model.parameters()).device == META  # and left there
    user.remove()
    assert not hasattr(model, "_hf_hook")


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator to move models between")
def test_cpu_offload_hook_sends_the_previous_model_back():
    device = torch.accelerator.current_accelerator()
    first, second = ModelForTest().eval(), ModelForTest().eval()
    first, hook1 = __import__("hasten.big_modeling", fromlist=["x"]).cpu_offload_with_hook(first, device)
    add_hook_to_module(second, CpuOffload(execution_device=device, prev_module_hook=hook1))
    first(torch.randn(2, 3))
    assert next(first.parameters()).device.type == device.type
    second(torch.randn(2, 3))
    assert next(first.parameters()).device == CPU


def test_fx_graph_module_hook():
    from torch.fx import symbolic_trace

    model = symbolic_trace(ModelForTest().eval())
    x = torch.randn(2, 3)
    expected = model(x)
    add_hook_to_module(model, PostForwardHook())
    torch.testing.assert_close(model(x), expected + 1)
    remove_hook_from_module(model)
    torch.testing.assert_close(model(x), expected)


def test_one_model_hook_class():
    import hasten.big_model.hooks as inner
    import hasten.hooks as public
    import hasten.utils.modeling as modeling

    assert public.ModelHook is inner.ModelHook
    assert public.add_hook_to_module is inner.add_hook_to_module
    assert modeling.set_module_tensor_to_device.__module__ == "hasten.big_model.tensors"


@pytest.mark.parametrize("value", [object(), 3])
def test_add_hook_refuses_non_modules(value):
    with pytest.raises(TypeError, match="add_hook_to_module: module"):
        add_hook_to_module(value, ModelHook())
