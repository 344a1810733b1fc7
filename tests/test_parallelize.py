"""The parallelize pipeline (issue 39): one function applies the steps in torchtitan's order,
each step takes its part of a frozen plan decided when the Accelerator chose its strategy, the
strategies build their own wrappers, and the precision gives FSDP what it needs instead of being
patched. One process; the sharded paths run for real in test_fsdp.py and test_parallelism.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin, GradScalerKwargs
from hasten.settings.handlers import DistributedDataParallelKwargs
from hasten.strategies import parallelize as pipeline
from hasten.strategies.parallelize import ParallelizePlan
from hasten.training.precision import Precision

SRC = Path(__file__).resolve().parent.parent / "src" / "hasten"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 2))


def test_the_plan_is_frozen_and_decided_at_construction():
    plugin = FullyShardedDataParallelPlugin(activation_checkpointing=True, transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(fsdp_plugin=plugin)
    plan = acc.strategy.plan
    assert isinstance(plan, ParallelizePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sharding = None  # type: ignore[misc]
    assert plan.blocks.policy == "transformer_based_wrap" and plan.blocks.class_names == ("Block",)
    assert plan.activation_checkpointing is not None and plan.materialise is not None
    assert plan.sharding is None and plan.tp is None and plan.ddp is None  # one process: nothing to shard over
    assert plan.autocast is acc.precision  # unsharded: the precision's autocast forward
    evaluation = plan.for_call(device_placement=False, evaluation_mode=True)
    assert evaluation.materialise is None and evaluation.activation_checkpointing is not None
    assert (evaluation.device_placement, evaluation.evaluation_mode) == (False, True)
    assert plan.evaluation_mode is False  # the strategy's own plan is unchanged
    # The single-device strategy's plan: placed, autocast, nothing else.
    single = Accelerator(mixed_precision="bf16").strategy.plan
    assert (single.blocks, single.activation_checkpointing, single.sharding, single.materialise) == (None,) * 4


def test_the_steps_run_in_torchtitans_order(monkeypatch):
    calls: list[str] = []
    steps = [
        "select_blocks",
        "resolve_tp",
        "move_to_meta",
        "apply_tp",
        "apply_activation_checkpointing",
        "apply_placement",
        "apply_autocast",
        "apply_compile",
        "apply_materialise",
    ]
    for name in steps:
        original = getattr(pipeline, name)

        def record(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(pipeline, name, record)
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    wrap = acc.strategy.wrap_model
    monkeypatch.setattr(acc.strategy, "wrap_model", lambda model, parts: calls.append("wrap") or wrap(model, parts))
    model = acc.prepare(_net())
    assert calls == steps[:-1] + ["wrap", "apply_materialise"]
    assert isinstance(model, torch.nn.Sequential)
    calls.clear()
    acc.prepare_model(_net(), evaluation_mode=True)
    assert "wrap" not in calls and calls[-1] == "apply_materialise"


def test_fp16_sharded_scaler_and_fsdp_policy_come_from_the_precision():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    handler = GradScalerKwargs(init_scale=8.0, growth_interval=3)
    sharded = Precision("fp16", torch.device("cpu"), scaler_handler=handler, sharded=True)
    assert isinstance(sharded.scaler, ShardedGradScaler) and sharded.scaler.get_scale() == 8.0
    plain = Precision("fp16", torch.device("cpu"), scaler_handler=handler)
    assert not isinstance(plain.scaler, ShardedGradScaler) and plain.sharded is False
    with pytest.raises(TypeError, match="sharded must be True or False"):
        Precision("no", torch.device("cpu"), sharded="yes")
    bf16 = Precision("bf16", torch.device("cpu"))
    assert bf16.fsdp_mixed_precision() == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert bf16.fsdp_mixed_precision(root=True).output_dtype == torch.float32
    given = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert bf16.fsdp_mixed_precision(given) is given and bf16.fsdp_mixed_precision(given, root=True) is given


def _calls_of(name: str) -> set[str]:
    """The source files under src/hasten that call ``name(...)`` (by plain name or attribute)."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                    found.add(str(path.relative_to(SRC)))
    return found


def test_each_wrapper_is_built_in_its_strategy_and_the_precision_is_not_patched():
    assert _calls_of("DistributedDataParallel") == {"strategies/ddp.py"}
    assert _calls_of("fully_shard") == {"strategies/fsdp.py"}
    assert _calls_of("register_comm_hook") == {"strategies/ddp.py", "settings/handlers.py", "settings/comm_hooks.py"}
    assert not hasattr(DistributedDataParallelKwargs, "build")
    patched = []  # assignments to <...>.precision.scaler anywhere: the precision chooses its own scaler
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            for target in getattr(node, "targets", []):
                owner = getattr(target, "value", None)
                if getattr(target, "attr", None) == "scaler" and "precision" in (
                    getattr(owner, "id", None),
                    getattr(owner, "attr", None),
                ):
                    patched.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not patched


def test_param_swaps_follow_a_chain_of_replacements_and_forget_dead_originals():
    import gc

    from hasten.strategies.parallelize import ParamSwaps

    swaps = ParamSwaps()
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    swaps.record([(a, b)])  # e.g. fp8 made a new weight
    swaps.record([(b, c)])  # then FSDP sharded it
    assert swaps.newest(a) is c and swaps.newest(b) is c and a in swaps
    opt = torch.optim.SGD([a, torch.nn.Parameter(torch.ones(1))], lr=0.1)
    swaps.rebind(opt)
    assert opt.param_groups[0]["params"][0] is c  # the other parameter stays as it was
    assert sorted(map(id, swaps.replaced())) == sorted(map(id, [a, b]))

    d, e = (torch.nn.Parameter(torch.zeros(1)) for _ in range(2))
    swaps.record([(d, e)])
    key = id(d)
    del d
    gc.collect()
    assert key not in swaps._newest  # a dead original is forgotten
    f = torch.nn.Parameter(torch.zeros(1))
    swaps.record([(e, f)])  # its replacement replaced again: the dead original does not come back
    assert key not in swaps._newest and swaps.newest(e) is f
