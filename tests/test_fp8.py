"""fp8 training through torchao's float8 layers (``mixed_precision="fp8"``), on one CPU process:
torchao emulates the fp8 matmuls here, with the numbers a GPU run gives.

The multi-process runs (FSDP2 on 2 gloo processes, TP 2 x FSDP 2 on 4) are in test_fp8_distributed.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

torchao = pytest.importorskip("torchao", reason="fp8 needs torchao (pip install 'hasten[fp8]')")

from hasten import Accelerator  # noqa: E402
from hasten.training import float8  # noqa: E402
from hasten.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs  # noqa: E402

STEPS = 30


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """A transformer-like stack whose Linear dims are multiples of 16, but for an odd head."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.odd = nn.Linear(width, 24 + 1)  # 25 outputs: not a multiple of 16, never converted
        self.head = nn.Linear(24 + 1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x if block is not self.blocks[0] else self.embed(x))
        return self.head(torch.relu(self.odd(x)))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 8, generator=g) / 4
    xs = [torch.randn(8, 16, generator=g) for _ in range(n)]
    return [(x, torch.tanh(x @ teacher)) for x in xs]


def fresh(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def train_hasten(model: nn.Module, **kwargs) -> list[float]:
    acc = Accelerator(**kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_by_hand(model: nn.Module, autocast: bool = True) -> list[float]:
    """torchao's float8 training written by hand: the same layers converted (Accelerate's filter),
    emulated, under bf16 autocast, with the CPU input cast torchao does for CUDA."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = {"embed", "head"}  # the first and last Linear
    config = Float8LinearConfig(emulate=True, pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda m, fqn: fqn not in keep and m.in_features % 16 == 0 and m.out_features % 16 == 0,
    )
    for m in model.modules():
        if type(m).__name__ == "Float8Linear":
            m.register_forward_pre_hook(
                lambda mod, args: (args[0].to(torch.bfloat16),) if torch.is_autocast_enabled("cpu") else None
            )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def float8_names(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")


@pytest.fixture(autouse=True)
def _quiet_emulation_note():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")
        yield


def test_fp8_trains_as_the_hand_written_torchao_loop_and_near_fp32():
    fp8 = train_hasten(fresh(), mixed_precision="fp8")
    by_hand = train_by_hand(fresh())
    fp32 = train_hasten(fresh())
    # The same fp8 numbers as torchao's own loop, step by step.
    assert fp8 == pytest.approx(by_hand, rel=1e-5, abs=1e-6)

    # fp8 learns as fp32 does. Measured on torch 2.13 CPU: the mean of the last 10 losses is
    # 0.181 in fp8 and 0.191 in fp32 (5% apart; single steps differ by up to 23%, bf16's by 11%),
    # from a first loss of 0.438.
    def tail(losses):
        return sum(losses[-10:]) / 10

    assert tail(fp8) < 0.6 * fp8[0]
    assert abs(tail(fp8) - tail(fp32)) / tail(fp32) < 0.15, (fp8, fp32)


def test_the_layers_converted_are_the_filters():
    model = fresh()
    acc = Accelerator(mixed_precision="fp8")
    prepared = acc.prepare(model)
    # Accelerate's filter: not the first (embed) nor the last (head) Linear, nor the 25-wide one.
    assert float8_names(acc.unwrap_model(prepared)) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    assert float8.chosen_layers(fresh(), None) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]

    only_up = AORecipeKwargs(module_filter_func=lambda m, fqn: fqn.endswith("up"))
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[only_up])
    assert float8_names(acc.unwrap_model(acc.prepare(fresh()))) == ["blocks.0.up", "blocks.1.up"]


def test_an_optimizer_built_before_prepare_trains_the_float8_weights():
    model = fresh()
    acc = Accelerator(mixed_precision="fp8")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    weight = acc.unwrap_model(model).blocks[0].up.weight
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"  # a new Parameter
    assert any(p is weight for g in opt.param_groups for p in g["params"])
    before = weight.detach().clone()
    x, y = batches(1)[0]
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    assert not torch.equal(before, weight.detach())


def test_a_filter_that_does_not_answer_true_or_false_is_refused_naming_the_layer():
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(module_filter_func=lambda m, n: "yes")])
    model = fresh()
    with pytest.raises(TypeError, match=r"module_filter_func must return True or False .* 'embed'"):
        acc.prepare(model)
    assert float8_names(model) == []  # nothing converted


def test_compile_composes_with_fp8():
    eager = train_hasten(fresh(), mixed_precision="fp8")
    compiled = train_hasten(fresh(), mixed_precision="fp8", dynamo_backend="aot_eager")
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)


def test_checkpoints_round_trip_and_exported_weights_are_plain(tmp_path):
    acc = Accelerator(mixed_precision="fp8")
    model = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    data = batches(6)
    for x, y in data[:3]:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    acc.save_state(tmp_path / "state")
    acc.save_model(model, tmp_path / "weights")
    plain = acc.get_state_dict(model)
    assert all(type(t) is torch.Tensor for t in plain.values()), {k: type(t) for k, t in plain.items()}
    plain = {k: t.clone() for k, t in plain.items()}  # as saved (the state dict shares the parameters' storage)

    def rest(m, o):
        out = []
        for x, y in data[3:]:
            loss = nn.functional.mse_loss(m(x), y)
            acc.backward(loss)
            o.step()
            o.zero_grad()
            out.append(loss.item())
        return out

    expected = rest(model, opt)

    acc2 = Accelerator(mixed_precision="fp8")
    model2 = fresh(seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2, opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(tmp_path / "state")
    acc = acc2
    assert rest(model2, opt2) == expected  # exactly the same steps after the reload

    # The exported weights load into the unconverted model, strictly, as plain tensors.
    from hasten.checkpoint import load_model

    unconverted = fresh(seed=9)
    load_model(unconverted, tmp_path / "weights")  # strict: every name and shape
    assert float8_names(unconverted) == []
    assert torch.equal(unconverted.blocks[0].up.weight, plain["blocks.0.up.weight"])
    assert fresh(seed=9).load_state_dict(plain, strict=True)  # get_state_dict's too
    # ... and back into an fp8 model
    acc3 = Accelerator(mixed_precision="fp8")
    model3 = acc3.prepare(fresh(seed=7))
    acc3.load_model(model3, tmp_path / "weights")
    assert torch.equal(acc3.get_state_dict(model3)["blocks.1.down.weight"], plain["blocks.1.down.weight"])


def test_unwrap_model_is_the_users_module_with_its_layers_converted():
    model = fresh()
    acc = Accelerator(mixed_precision="fp8")
    prepared = acc.prepare(model)
    assert acc.unwrap_model(prepared) is model
    assert float8_names(model)


def test_backend_and_handlers_as_accelerate_reports_them():
    acc = Accelerator(mixed_precision="fp8")
    assert acc.fp8_enabled and acc.fp8_backend == "AO" and isinstance(acc.ao_recipe_handler, AORecipeKwargs)
    assert acc.mixed_precision == "fp8"
    assert Accelerator().fp8_backend == "NO"


@pytest.mark.parametrize(
    "handler, words",
    [
        (lambda: TERecipeKwargs(), ["TransformerEngine", "transformer_engine", "not installed", "AORecipeKwargs"]),
        (lambda: MSAMPRecipeKwargs(), ["MS-AMP", "msamp", "not installed", "AORecipeKwargs"]),
        (lambda: FP8RecipeKwargs(backend="TE"), ["TransformerEngine", "no CUDA GPU"]),
    ],
)
def test_te_and_msamp_are_refused_at_the_accelerator_where_they_cannot_run(handler, words):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        given = handler()
    with pytest.raises(ValueError) as err:
        Accelerator(mixed_precision="fp8", kwargs_handlers=[given])
    for word in words:
        assert word in str(err.value), err.value


def test_the_cpu_says_once_that_it_emulates():
    float8._say_emulated.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Accelerator(mixed_precision="fp8")
        Accelerator(mixed_precision="fp8")
    notes = [w for w in seen if "torchao emulates the fp8 matmuls" in str(w.message)]
    assert len(notes) == 1


def test_plain_state_dict_unwraps_only_float8_weights():
    model = fresh()
    acc = Accelerator(mixed_precision="fp8")
    acc.prepare(model)
    raw = model.state_dict()
    assert any(type(t).__name__ == "WeightWithDynamicFloat8CastTensor" for t in raw.values())
    plain = float8.plain_state_dict(raw)
    assert set(plain) == set(raw)
    assert all(type(t) is torch.Tensor for t in plain.values())
    assert plain["blocks.0.up.weight"].data_ptr() == raw["blocks.0.up.weight"]._tensor.data_ptr()  # no copy
    assert copy.deepcopy(plain)["odd.weight"].shape == (25, 32)


def _runs_fp8_natively() -> bool:
    return float8.runs_natively()[0]


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(
    not (_have("transformer_engine") and _runs_fp8_natively()),
    reason="needs TransformerEngine and a CUDA GPU of compute capability 8.9 or newer",
)
def test_transformer_engine_converts_the_layers_and_trains():
    import transformer_engine.pytorch as te

    model = fresh().cuda()
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    inner = acc.unwrap_model(model)
    assert isinstance(inner.blocks[0].up, te.Linear) and isinstance(inner.blocks[0].norm, te.LayerNorm)
    assert not isinstance(inner.odd, te.Linear)  # 25 outputs: not a multiple of 16
    losses = []
    for x, y in batches(10):
        loss = nn.functional.mse_loss(model(x.cuda()), y.cuda())
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.skipif(
    not (_have("msamp") and _runs_fp8_natively()), reason="needs MS-AMP and a CUDA GPU of compute capability 8.9+"
)
def test_msamp_initializes_the_model_and_optimizer_together():
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[MSAMPRecipeKwargs(opt_level="O2")])
    model = fresh().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared_model, prepared_opt = acc.prepare(model, opt)
    assert type(prepared_opt.optimizer).__module__.startswith("msamp")
    with pytest.raises(ValueError, match="one model and one optimizer together"):
        acc.prepare(fresh().cuda())


def test_msamp_needs_the_model_and_optimizer_in_one_call():
    model = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"one model and one optimizer together to prepare\(\), got 1 model"):
        float8.msamp_initialize((model,), "O2")
    with pytest.raises(ValueError, match="got 2 model"):
        float8.msamp_initialize((model, fresh(), opt), "O2")
    loader = [1, 2]
    assert float8.msamp_initialize((loader,), "O2") == (loader,)  # nothing to initialise


def test_without_torchao_the_accelerator_names_the_extra(monkeypatch):
    monkeypatch.setattr(float8, "torchao_float8", lambda: None)
    with pytest.raises(ImportError, match=r"needs torchao, which is not installed: pip install 'hasten\[fp8\]'"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])


def test_the_recipe_handlers_import_from_hasten_too():
    import hasten

    assert hasten.AORecipeKwargs is AORecipeKwargs and hasten.FP8RecipeKwargs is FP8RecipeKwargs
    assert hasten.TERecipeKwargs is TERecipeKwargs and hasten.MSAMPRecipeKwargs is MSAMPRecipeKwargs
