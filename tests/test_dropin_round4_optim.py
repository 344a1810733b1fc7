"""Issue 41: the optimizer wrapper forwards the wrapped optimizer's attributes (schedule-free
optimizers' ``train()``/``eval()`` included), and the FSDP plugin takes every state-dict config
Accelerate takes and honours it (the 2-process part: scripts/dropin4_fsdp_state_dict.py)."""

from __future__ import annotations

import json
import pickle
import threading

import pytest
import torch
from torch import nn

from conftest import SCRIPTS, torchrun
from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.training.optimizer import AcceleratedOptimizer

TOL = 1e-5


class Custom(torch.optim.SGD):
    """An optimizer with fields and methods of its own, and schedule-free-like modes."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.custom_field = 7
        self.modes: list[str] = []

    def scale_lr(self, factor: float) -> float:
        for group in self.param_groups:
            group["lr"] *= factor
        return self.param_groups[0]["lr"]

    def train(self) -> None:
        self.modes.append("train")

    def eval(self) -> None:
        self.modes.append("eval")


def _prepared(optimizer_cls=Custom, **kwargs):
    acc = Accelerator(**kwargs)
    model = nn.Linear(3, 2)
    model, opt = acc.prepare(model, optimizer_cls(model.parameters()))
    return acc, model, opt


# ---------------------------------------------------------------------- forwarding
def test_wrapper_forwards_what_it_does_not_define():
    _, _, opt = _prepared()
    assert isinstance(opt, AcceleratedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert opt.custom_field == 7
    assert opt.scale_lr(0.5) == pytest.approx(0.05) and opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "scale_lr" in dir(opt) and "step_was_skipped" in dir(opt)
    opt.train()
    opt.eval()
    assert opt.optimizer.modes == ["train", "eval"]
    with pytest.raises(
        AttributeError,
        match=r"'AcceleratedOptimizer' object has no attribute 'no_such_thing', nor has the Custom it wraps",
    ):
        opt.no_such_thing  # noqa: B018
    # Writes: state, param_groups, defaults go to the wrapped optimizer (Accelerate's); the rest stays the wrapper's.
    opt.defaults = {"lr": 1.0}
    assert opt.optimizer.defaults == {"lr": 1.0}
    opt.custom_field = 8
    assert opt.custom_field == 8 and opt.optimizer.custom_field == 7


def test_wrapper_keeps_its_own_step_and_hooks_reach_the_wrapped_optimizer():
    acc, model, opt = _prepared(torch.optim.SGD, gradient_accumulation_steps=2)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o))  # torch's method, on the wrapped hooks
    x = torch.ones(4, 3)
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            opt.step()
            opt.zero_grad()
    assert calls == [opt.optimizer]  # one real step: the wrapper's step still skips the accumulating one
    opt.train()  # an optimizer without modes: nothing, as Accelerate's
    opt.eval()


def test_wrapper_without_its_optimizer_raises_attribute_error_not_recursion():
    bare = AcceleratedOptimizer.__new__(AcceleratedOptimizer)
    with pytest.raises(AttributeError, match=r"'AcceleratedOptimizer' object has no attribute 'optimizer'"):
        bare.optimizer  # noqa: B018
    with pytest.raises(AttributeError):
        bare.__deepcopy__  # noqa: B018 - dunders are never forwarded
    _, _, opt = _prepared(torch.optim.SGD)
    again = pickle.loads(pickle.dumps(opt))
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and again.real_steps == opt.real_steps


def test_mode_switch_waits_for_an_asynchronous_copy():
    acc, _, opt = _prepared()
    copied = threading.Event()
    acc._checkpointer.barrier.add(copied)
    threading.Timer(0.2, copied.set).start()
    opt.eval()  # rewrites the weights (schedule-free): only once the save copied them
    assert copied.is_set() and opt.optimizer.modes == ["eval"]
    assert acc._checkpointer.barrier.events == []


# ---------------------------------------------------------------------- schedule-free
def _schedule_free_loop(through_hasten: bool, accum: int) -> tuple[list[float], list[float], dict, dict]:
    """Accelerate's by_feature/schedule_free.py in small: optimizer.train() before training,
    optimizer.eval() before evaluation; losses, eval losses, the eval and the train weights."""
    schedulefree = pytest.importorskip("schedulefree", reason="schedulefree is not installed (the test extra)")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.02, warmup_steps=2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    test = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2)]
    acc = None
    if through_hasten:
        acc = Accelerator(gradient_accumulation_steps=accum)
        model, opt = acc.prepare(model, opt)
    losses, eval_losses = [], []
    for _ in range(2):
        model.train()
        opt.train()
        for i, (x, y) in enumerate(train):
            loss = nn.functional.mse_loss(model(x), y)
            if acc is not None:
                with acc.accumulate(model):
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
            else:
                (loss / accum).backward()
                if (i + 1) % accum == 0:
                    opt.step()
                    opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        opt.eval()
        with torch.no_grad():
            eval_losses += [nn.functional.mse_loss(model(x), y).item() for x, y in test]
    eval_weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.train()
    return losses, eval_losses, eval_weights, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("accum", [1, 2])
def test_schedule_free_trains_and_evaluates_as_plain_pytorch(accum):
    ref = _schedule_free_loop(False, accum)
    got = _schedule_free_loop(True, accum)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), rtol=TOL, atol=TOL)
    for weights_got, weights_ref in zip(got[2:], ref[2:]):
        assert weights_got.keys() == weights_ref.keys()
        for k in weights_ref:
            torch.testing.assert_close(weights_got[k], weights_ref[k], rtol=TOL, atol=TOL)
    # eval() really switched the weights (to the averaged ones), and train() back
    assert any(not torch.equal(got[2][k], got[3][k]) for k in got[2])


# ---------------------------------------------------------------------- FSDP state-dict configs
def test_plugin_takes_every_state_dict_config_accelerate_takes():
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    for offload in (False, True):
        for rank0 in (False, True):
            p = FullyShardedDataParallelPlugin(
                state_dict_type="FULL_STATE_DICT",
                state_dict_config=FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0),
                optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=rank0, rank0_only=offload),
            )
            assert p.full_gather("state_dict_config") == (offload, rank0)
            assert p.full_gather("optim_state_dict_config") == (rank0, offload)
        p = FullyShardedDataParallelPlugin(
            state_dict_config=ShardedStateDictConfig(offload_to_cpu=offload),
            optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=offload),
        )
        assert p.state_dict_type == "SHARDED_STATE_DICT"
    # Accelerate's example (by_feature/fsdp_with_peak_mem_tracking.py): no state_dict_type given, so the
    # full config says which (Accelerate's default type for its default FSDP version is the full one too).
    p = FullyShardedDataParallelPlugin(state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False))
    assert p.state_dict_type == "FULL_STATE_DICT" and p.full_gather() == (False, False)
    p = FullyShardedDataParallelPlugin(optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False))
    assert p.state_dict_type == "FULL_STATE_DICT" and p.full_gather("optim_state_dict_config") == (False, False)
    # None: Accelerate's default full config, on the main process's CPU.
    assert FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT").full_gather() == (True, True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"state_dict_type": "FULL_STATE_DICT", "state_dict_config": "ShardedStateDictConfig"},
            r"state_dict_config must be None or a torch.distributed.fsdp.FullStateDictConfig \(state_dict_type="
            r"'FULL_STATE_DICT'\), or state_dict_type='SHARDED_STATE_DICT' for a torch.distributed.fsdp."
            r"ShardedStateDictConfig, got ShardedStateDictConfig\(",
        ),
        (
            {"state_dict_type": "SHARDED_STATE_DICT", "optim_state_dict_config": "FullOptimStateDictConfig"},
            r"optim_state_dict_config must be None or a torch.distributed.fsdp.ShardedOptimStateDictConfig "
            r"\(state_dict_type='SHARDED_STATE_DICT'\), or state_dict_type='FULL_STATE_DICT' for a "
            r"torch.distributed.fsdp.FullOptimStateDictConfig, got FullOptimStateDictConfig\(",
        ),
        (
            {"state_dict_type": "FULL_STATE_DICT", "optim_state_dict_config": "FullStateDictConfig"},
            r"optim_state_dict_config must be None or a torch.distributed.fsdp.FullOptimStateDictConfig "
            r"\(state_dict_type='FULL_STATE_DICT'\), got FullStateDictConfig\(",
        ),
    ],
)
def test_plugin_refuses_a_config_of_the_other_kind_naming_both(kwargs, match, monkeypatch):
    import torch.distributed.fsdp as fsdp

    kwargs = {k: getattr(fsdp, v)() if k.endswith("_config") else v for k, v in kwargs.items()}
    with pytest.raises(TypeError, match=match):
        FullyShardedDataParallelPlugin(**kwargs)
    # the same type from Accelerate's environment variable: no full type implied over it
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", kwargs.pop("state_dict_type"))
    with pytest.raises(TypeError, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


def test_full_gather_maps_to_torchs_options(monkeypatch):
    """Where the state dict lands per (offload_to_cpu, rank0_only): torch's StateDictOptions
    says both with one flag; the other two gather the shards with torch's own function."""
    import torch.distributed._state_dict_utils as utils
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from hasten.strategies.fsdp import _gathered

    gathers = []
    monkeypatch.setattr(utils, "_gather_state_dict", lambda sd, **kw: gathers.append(kw) or sd)
    asked: list[StateDictOptions] = []

    def get(options):
        asked.append(options)
        return {"w": torch.ones(1)}

    expected = {
        None: (StateDictOptions(full_state_dict=False), None),
        (True, True): (StateDictOptions(full_state_dict=True, cpu_offload=True), None),
        (False, False): (StateDictOptions(full_state_dict=True, cpu_offload=False), None),
        (True, False): (StateDictOptions(full_state_dict=False), {"cpu_offload": True, "ranks_only": ()}),
        (False, True): (StateDictOptions(full_state_dict=False), {"cpu_offload": False, "ranks_only": (0,)}),
    }
    for gather, (options, gathered) in expected.items():
        asked.clear()
        gathers.clear()
        assert _gathered(get, gather) == {"w": torch.ones(1)}
        assert asked == [options] and gathers == ([gathered] if gathered else [])


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin4_fsdp")
    proc = torchrun(SCRIPTS / "dropin4_fsdp_state_dict.py", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        for name, entry in res.items():
            assert "error" not in entry, f"{name}: {entry['error']}"
    return ranks


@pytest.mark.parametrize(
    ("case", "model_everywhere", "optim_everywhere"),
    [("default", False, False), ("ff", True, True), ("tf", True, False), ("ft", False, True)],
)
def test_full_state_dicts_gathered_where_the_configs_say(fsdp_ranks, case, model_everywhere, optim_everywhere):
    main, other = fsdp_ranks[0][case], fsdp_ranks[1][case]
    assert main["layout"] == "full"
    assert main["keys"] and main["weight_diff"] <= TOL and main["devices"] == ["cpu"]
    assert main["optim_keys"] == main["keys"] and main["optim_full_shapes"]
    if model_everywhere:  # rank0_only=False: every process has the whole state dict
        assert other["keys"] == main["keys"] and other["weight_diff"] <= TOL
    else:
        assert other["keys"] == []
    if optim_everywhere:
        assert other["optim_keys"] == main["optim_keys"] and other["optim_full_shapes"]
        assert other["optim_sums"] == pytest.approx(main["optim_sums"], rel=1e-6, abs=1e-9)
    else:
        assert other["optim_keys"] == []


def test_full_configs_keep_save_model_and_the_full_checkpoint(fsdp_ranks):
    for res in fsdp_ranks:
        entry = res["ff"]
        assert entry["saved"] == (["model.safetensors"] if res is fsdp_ranks[0] else [])
        assert "model.safetensors" in entry["state_files"] and "optimizer.bin" in entry["state_files"]
        assert entry["restored_diff"] == 0.0
