"""The seams: the strategy chosen once, the registry of prepared objects, the checkpoint layout
seam, and the fp16 step that adds no device sync (issue 18)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hasten.checkpoint.layouts as layouts
from hasten import Accelerator, GradScalerKwargs
from hasten.strategies import Strategy, choose_strategy, unwrap_any
from hasten.strategies.single import SingleDeviceStrategy
from hasten.training.registry import PreparedObjects


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_one_process_gets_the_single_device_strategy():
    acc = Accelerator()
    assert isinstance(acc.strategy, SingleDeviceStrategy)
    assert choose_strategy(acc.state, acc.precision).name == "single"
    model = acc.prepare(_model())
    assert type(model) is torch.nn.Sequential  # not wrapped
    assert acc.strategy.checkpoint_layout == "full"


def test_the_registry_is_what_prepare_returned_in_order():
    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    reg = acc.registry
    assert isinstance(reg, PreparedObjects)
    assert reg.models == [model] and reg.optimizers == [opt] and reg.dataloaders == [loader]
    assert reg.schedulers == [sched] and sched.optimizers == [opt]
    assert acc._models is reg.models  # Accelerate's private names read the registry
    assert reg.counts() == {"models": 1, "optimizers": 1, "schedulers": 1, "dataloaders": 1, "custom_objects": 0}
    assert reg.real_steps() == 0 and reg.sync_steps() == 0
    acc.free_memory()
    assert reg.counts()["models"] == 0 and reg.optimizers == []


def test_unwrap_strips_torch_compile_and_keys_have_no_prefix():
    acc = Accelerator()
    model = _model()
    compiled = torch.compile(model, backend="eager")
    prepared = acc.prepare(compiled)
    assert acc.unwrap_model(prepared) is model
    assert acc.unwrap_model(prepared, keep_torch_compile=True) is compiled
    assert unwrap_any(prepared) is model
    assert sorted(acc.get_state_dict(prepared)) == sorted(model.state_dict())
    assert all(not k.startswith("_orig_mod.") for k in acc.get_state_dict(prepared))


def test_compiled_model_checkpoint_loads_into_an_eager_one(tmp_path):
    acc = Accelerator()
    compiled = acc.prepare(torch.compile(_model(), backend="eager"))
    compiled(torch.randn(3, 4))
    path = acc.save_state(tmp_path / "ckpt")
    with open(os.path.join(path, "hasten_checkpoint.json")) as f:
        names = set(json.load(f)["models"][0]["tensors"])
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}
    eager_acc = Accelerator()
    torch.manual_seed(1)
    eager = eager_acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    eager_acc.load_state(path)
    for a, b in zip(eager.state_dict().values(), acc.unwrap_model(compiled).state_dict().values()):
        assert torch.equal(a, b)


def test_unwrap_model_keeps_or_removes_the_autocast_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    inner = acc.unwrap_model(model)
    out = inner(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32  # autocast inside, fp32 out
    acc.unwrap_model(model, keep_fp32_wrapper=False)(torch.randn(2, 4))
    assert seen[-1] == torch.float32


def test_preparing_twice_autocasts_once():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    forward = model.forward
    acc.prepare(model)
    assert model.forward is forward


class _CountingScaler:
    """Counts get_scale() calls (each is a device sync on a GPU)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.calls = 0
        real = scaler.get_scale

        def get_scale() -> float:
            self.calls += 1
            return real()

        scaler.get_scale = get_scale  # type: ignore[method-assign]


def test_fp16_step_reads_no_scale_and_still_reports_skipped_steps():
    # 65536 (the default scale) is above fp16's largest value: the first step would overflow
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    counter = _CountingScaler(acc.scaler)
    # a scheduler made after prepare on the user's optimizer (torch wraps optimizer.step.__func__)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, gamma=0.5)
    x = torch.randn(4, 4)
    acc.backward(model(x).sum())
    opt.step()
    opt.zero_grad()
    assert not opt.step_was_skipped and opt.real_steps == 1
    acc.backward(model(x).sum() * float("inf"))  # inf gradients: the scaler skips the step
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped and opt.real_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    acc.backward(model(x).sum())
    opt.step()
    assert not opt.step_was_skipped and opt.real_steps == 2
    assert counter.calls == 0  # "skipped" came from the step itself, not from reading the scale
    sched.step()  # torch's scheduler wrapper around the tracked step works
    assert sched.get_last_lr() == [0.05]


def test_fp16_with_an_optimizer_that_scales_itself_compares_the_scale():
    acc = Accelerator(mixed_precision="fp16")
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt._step_supports_amp_scaling = True  # as fused optimizers declare
    assert acc.precision.track_steps(opt) is None


def test_a_new_strategy_only_implements_the_interface():
    class Recording(Strategy):
        name = "recording"

        def __init__(self, state, precision):
            super().__init__(state, precision)
            self.wrapped: list[torch.nn.Module] = []

        def _wrap(self, module):
            self.wrapped.append(module)
            return module

    acc = Accelerator()
    acc.strategy = Recording(acc.state, acc.precision)
    acc._checkpointer.ctx.strategy = acc.strategy
    model = acc.prepare(_model())
    assert acc.strategy.wrapped == [model]


def test_unknown_layout_is_a_clear_error(tmp_path):
    acc = Accelerator()
    acc.prepare(_model())
    path = acc.save_state(tmp_path / "ckpt")
    manifest_path = os.path.join(path, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    assert manifest["layout"] == "full"
    manifest["layout"] = "sharded-by-magic"
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="layout 'sharded-by-magic' is not known.*known: "):
        acc.load_state(path)
    with pytest.raises(ValueError, match="not known"):
        layouts.get_layout("nope")


def test_a_manifest_without_layout_reads_as_full(tmp_path):
    acc = Accelerator()
    acc.prepare(_model())
    path = acc.save_state(tmp_path / "ckpt")
    manifest_path = os.path.join(path, "hasten_checkpoint.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    del manifest["layout"]  # written by hasten before the layout field existed
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    assert acc.load_state(path) == path
