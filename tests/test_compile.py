"""torch.compile through Accelerate's dynamo options (issue 15), on one process with aot_eager.

Two processes (DDP) are in tests/scripts/core_checks.py; inductor in the `slow` test below and
in the compile benchmark (bench/scripts/compile_speed.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import hasten.settings.config_file as hasten_config
from hasten import Accelerator, DynamoBackend, TorchDynamoPlugin
from hasten.checkpoint import load_model
from hasten.training.compile import repeated_blocks


class Block(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self, blocks: int = 3, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _step(acc: Accelerator, model, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    acc.backward(out.pow(2).mean())
    return out.detach(), [p.grad.clone() for p in acc.unwrap_model(model).parameters()]


@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_compiled_outputs_and_gradients_equal_eager(regional, mixed_precision):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    eager_acc = Accelerator(mixed_precision=mixed_precision)
    eager = eager_acc.prepare(_net())
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=regional)
    acc = Accelerator(mixed_precision=mixed_precision, dynamo_plugin=plugin)
    compiled = acc.prepare(_net())
    assert type(compiled).__name__ == ("Net" if regional else "OptimizedModule")
    tol = 1e-5 if mixed_precision == "no" else 1e-2
    for _ in range(2):
        (out_e, grads_e), (out_c, grads_c) = _step(eager_acc, eager, x), _step(acc, compiled, x)
        torch.testing.assert_close(out_c, out_e, rtol=tol, atol=tol)
        for g_c, g_e in zip(grads_c, grads_e):
            torch.testing.assert_close(g_c, g_e, rtol=tol, atol=tol)


def test_regional_compilation_compiles_each_repeated_block_in_place():
    model = _net()
    blocks = repeated_blocks(model)
    assert blocks == list(model.layers)  # not the Linear layers, not the head
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    prepared = acc.prepare(model)
    assert prepared is model and all(b._compiled_call_impl is not None for b in model.layers)
    assert model.embed._compiled_call_impl is None
    assert acc.unwrap_model(prepared) is model and acc.unwrap_model(prepared, keep_torch_compile=True) is model


def test_a_model_without_repeated_blocks_is_compiled_whole_with_a_warning():
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    with pytest.warns(UserWarning, match="no repeated blocks.*compiling the whole model"):
        prepared = acc.prepare(torch.nn.Linear(4, 2))
    assert type(prepared).__name__ == "OptimizedModule"


def test_unwrap_model_and_keep_torch_compile():
    model = _net()
    acc = Accelerator(dynamo_backend="aot_eager")
    compiled = acc.prepare(model)
    assert acc.unwrap_model(compiled) is model
    kept = acc.unwrap_model(compiled, keep_torch_compile=True)
    assert kept is compiled and kept._orig_mod is model


@pytest.mark.parametrize("save_compiled", [True, False])
def test_checkpoints_move_between_compiled_and_eager_runs(tmp_path, save_compiled):
    def make(compiled: bool, seed: int):
        acc = Accelerator(dynamo_backend="aot_eager" if compiled else None)
        model = _net(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    acc, model, opt = make(save_compiled, 0)
    x = torch.randn(8, 4)
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    path = acc.save_state(tmp_path / "ckpt")
    acc.save_model(model, tmp_path / "hf")
    names = set(acc.get_state_dict(model))
    assert names == set(_net().state_dict()) and not any("_orig_mod" in n or n.startswith("module.") for n in names)
    other_acc, other, other_opt = make(not save_compiled, 1)
    other_acc.load_state(path)
    for a, b in zip(acc.get_state_dict(model).values(), other_acc.get_state_dict(other).values()):
        assert torch.equal(a, b)
    torch.testing.assert_close(other(x), model(x))
    fresh = _net(2)
    load_model(fresh, tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), acc.get_state_dict(model).values()))


def test_state_dicts_with_wrapper_prefixes_load(tmp_path):
    """Written by other tools from a compiled or DDP-wrapped model: `_orig_mod.` / `module.` prefixes."""
    source = _net(3)
    prefixed = {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}
    acc = Accelerator(dynamo_backend="aot_eager")
    model = acc.prepare(_net(4))
    acc.strategy.load_model_state_dict(model, prefixed)
    assert all(torch.equal(a, b) for a, b in zip(acc.get_state_dict(model).values(), source.state_dict().values()))
    import safetensors.torch

    os.makedirs(tmp_path / "hf")
    safetensors.torch.save_file(
        {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}, tmp_path / "hf" / "model.safetensors"
    )
    plain = _net(5)
    load_model(plain, tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), source.state_dict().values()))


_COMPILES: list[int] = []


def _counting_backend(gm, example_inputs):
    _COMPILES.append(len(example_inputs))
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)


def test_an_uneven_last_batch_recompiles_at_most_once_over_three_epochs():
    import torch._dynamo
    from torch._dynamo.backends import registry

    torch._dynamo.reset()
    if "hasten_counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(name="hasten_counting")(_counting_backend)
    _COMPILES.clear()
    try:
        acc = Accelerator(dynamo_backend="hasten_counting")
        model = acc.prepare(_net())
        loader = acc.prepare(torch.utils.data.DataLoader(torch.randn(22, 4), batch_size=8))  # 8, 8, 6
        for _ in range(3):
            for x in loader:
                acc.backward(model(x).pow(2).mean())
    finally:  # unregistered again: other tests (and docs/errors.md) list the registered backends
        registry._BACKENDS.pop("hasten_counting", None)
        registry._COMPILER_FNS.pop("hasten_counting", None)
    assert 1 <= len(_COMPILES) <= 2, _COMPILES  # the full batches, then one dynamic graph for the last


def test_the_profiler_labels_a_compiled_model(tmp_path):
    from hasten import ProfileKwargs

    acc = Accelerator(dynamo_backend="aot_eager")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, 4)
    with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
        for _ in range(2):
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
    trace = (tmp_path / "trace_rank0.json").read_text()
    assert "hasten.forward" in trace and "hasten.backward" in trace and "hasten.optimizer_step" in trace


def test_launcher_settings_reach_the_plugin(monkeypatch):
    monkeypatch.setenv("HASTEN_DYNAMO_BACKEND", "aot_eager")
    monkeypatch.setenv("HASTEN_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    monkeypatch.setenv("HASTEN_DYNAMO_MODE", "max-autotune")
    acc = Accelerator()
    assert acc.dynamo_plugin.backend == "aot_eager" and acc.dynamo_plugin.use_regional_compilation
    assert acc.dynamo_plugin.mode == "max-autotune" and acc.strategy.compiler is not None
    assert Accelerator(dynamo_backend="no").strategy.compiler is None  # code wins


def test_config_file_dynamo_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dynamo:\n  backend: INDUCTOR\n  mode: reduce-overhead\n  use_regional_compilation: true\n")
    cfg = hasten_config.load_config(path)
    assert cfg.launch == {
        "dynamo_backend": "inductor",
        "dynamo_mode": "reduce-overhead",
        "dynamo_use_regional_compilation": True,
    }
    path.write_text("dynamo_config:\n  dynamo_backend: aot_eager\n  dynamo_use_fullgraph: true\n")  # Accelerate's
    assert hasten_config.load_config(path).launch == {"dynamo_backend": "aot_eager", "dynamo_use_fullgraph": True}
    path.write_text("dynamo:\n  backnd: inductor\n")
    with pytest.raises(ValueError, match="unknown key 'backnd'; did you mean 'backend'"):
        hasten_config.load_config(path)


def test_plugin_fields_and_accelerate_spellings():
    plugin = TorchDynamoPlugin(backend=DynamoBackend.AOT_EAGER)
    assert plugin.backend == "aot_eager" and plugin.mode == "default" and plugin.fullgraph is False
    assert plugin.dynamic is None and plugin.use_regional_compilation is False and plugin.enabled
    assert plugin.compile_kwargs() == {"backend": "aot_eager", "mode": "default", "fullgraph": False, "dynamic": None}
    assert plugin.to_kwargs() == {"backend": "aot_eager"}  # as every handler's: what differs from the defaults
    assert TorchDynamoPlugin(backend="aot_eager", options={"x": 1}).compile_kwargs()["options"] == {"x": 1}
    assert not TorchDynamoPlugin().enabled and not TorchDynamoPlugin(backend="eager", disable=True).enabled


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"backend": "nope"}, ValueError, ("TorchDynamoPlugin.backend", "'nope'", "'aot_eager'", "'inductor'")),
        ({"backend": 3}, TypeError, ("TorchDynamoPlugin.backend", "3")),
        (
            {"backend": "eager", "mode": "fastest"},
            ValueError,
            ("TorchDynamoPlugin.mode", "'fastest'", "'max-autotune'"),
        ),
        ({"backend": "eager", "fullgraph": "yes"}, TypeError, ("TorchDynamoPlugin.fullgraph",)),
        (
            {"backend": "eager", "mode": "max-autotune", "options": {"a": 1}},
            ValueError,
            ("mode='max-autotune'", "options"),
        ),
    ],
)
def test_bad_plugin_values(kwargs, error, words):
    with pytest.raises(error) as info:
        TorchDynamoPlugin(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_dynamo_backend_and_plugin_together_is_an_error():
    with pytest.raises(ValueError, match="dynamo_backend='eager' and dynamo_plugin="):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    with pytest.raises(TypeError, match="dynamo_plugin must be a TorchDynamoPlugin"):
        Accelerator(dynamo_plugin={"backend": "eager"})


@pytest.mark.slow
def test_inductor_matches_eager():
    x = torch.randn(8, 4)
    eager_acc, acc = Accelerator(), Accelerator(dynamo_backend="inductor")
    eager, compiled = eager_acc.prepare(_net()), acc.prepare(_net())
    (out_e, grads_e), (out_c, grads_c) = _step(eager_acc, eager, x), _step(acc, compiled, x)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-5)


def test_unwrap_model_opens_the_users_own_data_parallel_inside_a_compiled_model():
    # Accelerate's unwrap_model removes DataParallel/DDP the user wrapped; with keep_torch_compile
    # the result is compiled around the module itself, and the user's compiled wrapper is left alone.
    model = torch.nn.Linear(2, 4)
    compiled = torch.compile(torch.nn.DataParallel(model), backend="eager")
    accelerator = Accelerator()
    assert accelerator.unwrap_model(compiled) is model
    kept = accelerator.unwrap_model(compiled, keep_torch_compile=True)
    assert kept is not compiled and kept._orig_mod is model
    assert isinstance(compiled._orig_mod, torch.nn.DataParallel)  # not mutated
    x = torch.randn(3, 2)
    assert torch.equal(kept(x), model(x))
    direct = torch.compile(model, backend="eager")
    assert accelerator.unwrap_model(direct, keep_torch_compile=True) is direct


def test_accelerates_backend_names_are_accepted_by_the_plugin(monkeypatch):
    # As Accelerate: a DynamoBackend name this torch has not registered is accepted by the plugin
    # (so configuration code runs); the Accelerator that would compile with it refuses it.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_ts_nvfuser")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "reduce-overhead")
    plugin = TorchDynamoPlugin()
    assert plugin.to_kwargs() == {"backend": "aot_ts_nvfuser", "mode": "reduce-overhead"}  # what differs
    assert plugin.compile_kwargs() == {
        "backend": "aot_ts_nvfuser",
        "mode": "reduce-overhead",
        "fullgraph": False,
        "dynamic": None,
    }
    with pytest.raises(ValueError, match="'aot_ts_nvfuser' is not a torch.compile backend of this torch"):
        Accelerator(dynamo_plugin=plugin)
    with pytest.raises(ValueError, match="got 'fastest'"):
        TorchDynamoPlugin(backend="fastest")
