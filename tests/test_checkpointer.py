"""The Checkpointer's seams (issue 39): layouts only plan, an executor writes, the commit step
completes; the barrier an optimizer step waits on is the Accelerator's own object, given at
prepare; a read returns a typed ``Restore``; the manifest reads the version from ``hasten._version``.
One process, no launch.
"""

from __future__ import annotations

import ast
import json
import os
import threading
from pathlib import Path

import pytest
import torch

import hasten
from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.checkpoint import background, checksums
from hasten.checkpoint.layouts import get_layout
from hasten.checkpoint.plans import FileWrite, LoadOptions, Restore, SavePlan, ShardedWrite


def _prepared(tmp_path, fsdp=False):
    acc = Accelerator(cpu=True, **({"fsdp_plugin": FullyShardedDataParallelPlugin()} if fsdp else {}))
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return acc, model, opt


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_layout_plans_and_writes_nothing_the_executor_writes_the_plan(tmp_path, fsdp):
    acc, model, _ = _prepared(tmp_path, fsdp)
    ctx = acc._checkpointer.ctx
    layout = get_layout(ctx.strategy.checkpoint_layout)
    assert layout.name == ("dcp" if fsdp else "full")
    before = sorted(os.listdir(tmp_path))
    plan = layout.plan_save(ctx, layout.weights(ctx, [model]), safe=True)
    assert isinstance(plan, SavePlan) and sorted(os.listdir(tmp_path)) == before  # planned, nothing written
    names = [(f.name, f.kind, f.large) for f in plan.files]
    shared = [("scheduler_0.pt", "torch", False), ("loop_state.json", "json", False), ("rank_0.pt", "torch", False)]
    if not fsdp:  # the "full" layout writes Accelerate's names (the "dcp" one hasten's)
        shared = [("scheduler.bin", "torch", False), shared[1], ("random_states_0.pkl", "torch", False)]
    if fsdp:  # every process's shards, a DCP folder each; the rest are files
        assert [s.folder for s in plan.sharded] == ["model_0", "optimizer_0"]
        assert all(isinstance(s, ShardedWrite) for s in plan.sharded)
        assert names == shared and plan.manifest.models[0]["dir"] == "model_0"
    else:  # the large files are copied to host memory by an asynchronous save
        assert plan.sharded == []
        assert names == [("model.safetensors", "weights", True), ("optimizer.bin", "torch", True), *shared]
        assert plan.manifest.models[0]["file"] == "model.safetensors"
    assert plan.manifest.models[0]["tensors"] == {
        "weight": {"shape": [3, 4], "dtype": "float32"},
        "bias": {"shape": [3], "dtype": "float32"},
    }
    assert plan.manifest.world_size == 1 and plan.manifest.counts["optimizers"] == 1

    tmp = tmp_path / "written"
    tmp.mkdir()
    report = acc._checkpointer.now.write(plan, str(tmp))
    on_disk = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    assert sorted(report.files) == on_disk and report.manifest is plan.manifest
    for name, rec in report.files.items():  # hashed as written: what a second pass over the file finds
        assert checksums.verify_file(str(tmp / name), rec) is None, name


def test_a_plan_item_is_typed():
    item = FileWrite("x.pt", {"a": 1})
    assert (item.kind, item.safe, item.large) == ("torch", False, False)
    with pytest.raises(AttributeError):
        item.name = "y.pt"  # frozen: an executor cannot change what the layout planned


def test_the_barrier_is_the_accelerators_and_its_optimizers_hold_it(tmp_path, monkeypatch):
    """Each Accelerator has its barrier (not a module global): an asynchronous save of one holds
    back its own optimizers' next step, not another Accelerator's."""
    import hasten.training.optimizer

    assert not hasattr(hasten.training.optimizer, "copies_in_flight") and not hasattr(
        hasten.training.optimizer, "wait_for_copies"
    )
    acc, model, opt = _prepared(tmp_path)
    other, other_model, other_opt = _prepared(tmp_path)
    barrier = acc._checkpointer.barrier
    assert barrier is not other._checkpointer.barrier
    assert opt._copies is barrier and other_opt._copies is other._checkpointer.barrier
    gate = threading.Event()
    monkeypatch.setattr(background, "before_stage", lambda: gate.wait(60))
    acc.save_state(str(tmp_path / "ck"), async_save=True)
    assert len(barrier.events) == 1 and not barrier.events[0].is_set() and not other._checkpointer.barrier.events
    other_model(torch.randn(2, 4)).sum().backward()
    other_opt.step()  # not held back by the other Accelerator's save
    assert not gate.is_set()
    threading.Timer(0.2, gate.set).start()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # waits for the copy
    assert gate.is_set() and not barrier.events
    acc.wait_for_checkpoint()
    assert (tmp_path / "ck" / "hasten_checkpoint.json").is_file()


@pytest.mark.parametrize("async_save", [False, True])
def test_each_save_runs_on_the_executor_it_asked_for(tmp_path, monkeypatch, async_save):
    acc, _, _ = _prepared(tmp_path)
    ran = []
    for name in ("now", "background"):
        executor = getattr(acc._checkpointer, name)
        real = executor.run
        monkeypatch.setattr(
            executor, "run", lambda txn, plan, real=real, name=name: (ran.append(name), real(txn, plan))[1]
        )
    acc.save_state(str(tmp_path / "ck"), async_save=async_save)
    acc.wait_for_checkpoint()
    assert ran == ["background" if async_save else "now"]
    assert (tmp_path / "ck" / "hasten_checkpoint.json").is_file()


def test_a_read_is_a_typed_restore_with_no_magic_keys(tmp_path):
    acc, model, _ = _prepared(tmp_path)
    path = acc.save_state(str(tmp_path / "ck"))
    ctx = acc._checkpointer.ctx
    manifest = json.loads((Path(path) / "hasten_checkpoint.json").read_text())
    r = get_layout("full").read(ctx, path, manifest, [model], LoadOptions())
    assert isinstance(r, Restore) and r.warning is None and r.where == f"the checkpoint {path!r}"
    assert len(r.models) == len(r.optimizers) == len(r.schedulers) == 1 and r.rng is not None
    assert r.optimizer_counters == [{"real_steps": 1, "sync_steps": 1}]


def test_the_manifest_takes_the_version_from_its_own_module(tmp_path):
    """No module of the checkpoint package imports from the package above it (``from .. import
    __version__`` made the manifest import ``hasten`` itself)."""
    from hasten import _version

    source = Path(hasten.checkpoint.__file__).parent
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is None and node.level >= 2:
                names = [a.name for a in node.names]
                assert "__version__" not in names, f"{path.name} imports __version__ from the package"
    acc, _, _ = _prepared(tmp_path)
    path = acc.save_state(str(tmp_path / "ck"))
    manifest = json.loads((Path(path) / "hasten_checkpoint.json").read_text())
    assert manifest["hasten_version"] == _version.__version__ == hasten.__version__
