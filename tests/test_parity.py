"""Accelerate's API beyond the core: ProjectConfiguration, GradientAccumulationPlugin,
DataLoaderConfiguration and the small Accelerator methods; the 2-process checks (trackers,
sync_each_batch, split batches, trigger, on_process, join) share one launch of scripts/parity_checks.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from hasten.training.rng import set_seed
from launch_utils import SCRIPTS, launch, launch_env, read_ranks


def _prepared(accelerator: Accelerator, n: int = 8, batch_size: int = 2):
    set_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)), batch_size=batch_size)
    return accelerator.prepare(model, optimizer, loader)


# ---------------------------------------------------------------------- ProjectConfiguration


def test_project_configuration_fields_and_logging_dir_default(tmp_path):
    config = ProjectConfiguration(project_dir=tmp_path)
    assert config.project_dir == str(tmp_path) and config.logging_dir == str(tmp_path)
    assert (config.automatic_checkpoint_naming, config.total_limit, config.iteration, config.save_on_each_node) == (
        False,
        None,
        0,
        False,
    )
    other = ProjectConfiguration(project_dir=tmp_path, logging_dir=tmp_path / "logs")
    assert other.logging_dir == str(tmp_path / "logs")
    accelerator = Accelerator(project_config=other)
    assert accelerator.project_configuration is other
    assert accelerator.project_dir == str(tmp_path) and accelerator.logging_dir == str(tmp_path / "logs")
    assert accelerator.save_iteration == 0


def test_project_dir_fills_a_configuration_without_one_and_a_conflict_is_an_error(tmp_path):
    accelerator = Accelerator(project_dir=tmp_path, project_config=ProjectConfiguration(total_limit=2))
    assert accelerator.project_dir == str(tmp_path) and accelerator.logging_dir == str(tmp_path)
    same = Accelerator(project_dir=str(tmp_path), project_config=ProjectConfiguration(project_dir=tmp_path))
    assert same.project_dir == str(tmp_path)
    with pytest.raises(ValueError, match="conflicts with ProjectConfiguration\\(project_dir="):
        Accelerator(project_dir=tmp_path / "a", project_config=ProjectConfiguration(project_dir=tmp_path / "b"))
    with pytest.raises(TypeError, match="project_config must be a ProjectConfiguration"):
        Accelerator(project_config={"project_dir": "x"})


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"project_dir": 5}, TypeError, "ProjectConfiguration.project_dir must be a path"),
        ({"logging_dir": 1.5}, TypeError, "ProjectConfiguration.logging_dir must be a path"),
        ({"automatic_checkpoint_naming": "yes"}, TypeError, "automatic_checkpoint_naming must be True or False"),
        ({"total_limit": 0}, ValueError, "ProjectConfiguration.total_limit must be >= 1, got 0"),
        ({"iteration": -1}, ValueError, "ProjectConfiguration.iteration must be >= 0, got -1"),
        ({"save_on_each_node": 1}, TypeError, "save_on_each_node must be True or False"),
    ],
)
def test_project_configuration_refuses_bad_values(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", "\\(").replace(")", "\\)")):
        ProjectConfiguration(**kwargs)


def test_automatic_checkpoint_naming_total_limit_and_iteration(tmp_path):
    config = ProjectConfiguration(project_dir=tmp_path, automatic_checkpoint_naming=True, total_limit=2, iteration=3)
    accelerator = Accelerator(project_config=config)
    model, optimizer, loader = _prepared(accelerator)
    root = tmp_path / "checkpoints"
    first = accelerator.save_state()
    assert first == str(root / "checkpoint_3") and config.iteration == 4  # starts at the configured iteration
    with pytest.warns(UserWarning, match="output_dir=.*is ignored.*automatic_checkpoint_naming=True"):
        second = accelerator.save_state(tmp_path / "elsewhere")
    assert second == str(root / "checkpoint_4") and not (tmp_path / "elsewhere").exists()
    accelerator.save_state()
    assert sorted(os.listdir(root)) == [
        ".hasten-lock",
        "checkpoint_4",
        "checkpoint_5",
    ]  # the configuration's total_limit
    accelerator.save_state(total_limit=1)  # the call's own limit wins
    assert sorted(os.listdir(root)) == [".hasten-lock", "checkpoint_6"] and accelerator.save_iteration == 7
    # A fresh run with iteration 0 does not overwrite: N is past the largest existing one.
    fresh = Accelerator(project_config=ProjectConfiguration(project_dir=tmp_path, automatic_checkpoint_naming=True))
    _prepared(fresh)
    assert fresh.load_state() == str(root / "checkpoint_6")
    assert fresh.save_state() == str(root / "checkpoint_7")


def test_manual_saves_count_the_iteration_too(tmp_path):
    accelerator = Accelerator(project_dir=tmp_path)
    _prepared(accelerator)
    accelerator.save_state(tmp_path / "manual")
    assert accelerator.save_iteration == 1


def test_save_on_each_node(tmp_path):
    """save() writes on each machine's local main process; a multi-machine save_state is refused."""
    accelerator = Accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    accelerator.state.process_index = 1  # as the local main process of a second machine sees itself
    accelerator.save({"a": 1}, tmp_path / "each.pt")
    assert torch.load(tmp_path / "each.pt") == {"a": 1}
    plain = Accelerator()
    plain.state.process_index = 1
    plain.save({"a": 1}, tmp_path / "main_only.pt")
    assert not (tmp_path / "main_only.pt").exists()
    accelerator.state.num_processes, accelerator.state.num_local_processes = 4, 2
    with pytest.raises(ValueError, match="save_on_each_node=True\\) on 2 machines is not supported"):
        accelerator.save_state(tmp_path / "ckpt")


# ---------------------------------------------------------------------- GradientAccumulationPlugin


def _sync_pattern(accelerator: Accelerator, batches: int, epochs: int) -> list[list[bool]]:
    model, optimizer, loader = _prepared(accelerator, n=2 * batches, batch_size=2)
    pattern = []
    for _ in range(epochs):
        epoch = []
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            epoch.append(accelerator.sync_gradients)
        pattern.append(epoch)
    return pattern


def test_plugin_num_steps_and_sync_with_dataloader():
    plugin = GradientAccumulationPlugin(num_steps=2)
    assert _sync_pattern(Accelerator(gradient_accumulation_plugin=plugin), 3, 2) == [[False, True, True]] * 2
    # The cycle runs on into the next epoch instead of ending with the dataloader.
    running = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    )
    assert running.gradient_accumulation_steps == 2
    assert _sync_pattern(running, 3, 2) == [[False, True, False], [True, False, True]]


def test_plugin_num_steps_none_reads_the_launcher_or_is_one(monkeypatch):
    assert Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin()).gradient_accumulation_steps == 1
    monkeypatch.setenv("HASTEN_GRADIENT_ACCUMULATION_STEPS", "3")
    assert Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin()).gradient_accumulation_steps == 3
    with pytest.warns(UserWarning, match="gradient_accumulation_plugin.num_steps=2\\) in code overrides"):
        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))


def _scheduler_steps(plugin: GradientAccumulationPlugin | None, batches: int, **kwargs) -> tuple[int, int]:
    accelerator = Accelerator(gradient_accumulation_plugin=plugin, **kwargs)
    set_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = DataLoader(TensorDataset(torch.randn(2 * batches, 3), torch.randn(2 * batches, 1)), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return scheduler.scheduler.last_epoch, optimizer.real_steps


def test_the_schedule_follows_optimizer_steps_whatever_adjust_scheduler_says():
    # 5 batches, cycles of 2, 2 and 1 (the dataloader's end): 3 optimizer steps, 3 scheduler steps,
    # as an Accelerate script sized in optimizer steps expects (Accelerate's adjust_scheduler does
    # not move the learning rate either).
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=2), 5) == (3, 3)
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False), 5) == (3, 3)
    assert _scheduler_steps(None, 5, gradient_accumulation_steps=2) == (3, 3)
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=1), 5) == (5, 5)


def test_plugin_and_steps_together_is_an_error():
    with pytest.raises(
        ValueError, match="both gradient_accumulation_steps=2 and gradient_accumulation_plugin=.*pass one"
    ):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert (
        Accelerator(
            gradient_accumulation_steps=1, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4)
        ).gradient_accumulation_steps
        == 4
    )  # as Accelerate: 1 is its default
    with pytest.raises(TypeError, match="gradient_accumulation_plugin must be a GradientAccumulationPlugin"):
        Accelerator(gradient_accumulation_plugin={"num_steps": 2})


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"num_steps": 0}, ValueError, "GradientAccumulationPlugin.num_steps must be >= 1, got 0"),
        ({"num_steps": 2.0}, TypeError, "GradientAccumulationPlugin.num_steps must be an integer"),
        ({"adjust_scheduler": 1}, TypeError, "adjust_scheduler must be True or False"),
        ({"sync_with_dataloader": None}, TypeError, "sync_with_dataloader must be True or False"),
        ({"sync_each_batch": "yes"}, TypeError, "sync_each_batch must be True or False"),
    ],
)
def test_plugin_refuses_bad_values(kwargs, error, words):
    with pytest.raises(error, match=words):
        GradientAccumulationPlugin(**kwargs)


# ---------------------------------------------------------------------- DataLoaderConfiguration


def test_dataloader_configuration_reaches_prepare():
    config = DataLoaderConfiguration(split_batches=True, even_batches=False, dispatch_batches=False, non_blocking=True)
    accelerator = Accelerator(dataloader_config=config)
    assert accelerator.dataloader_config is config
    assert (accelerator.split_batches, accelerator.even_batches, accelerator.dispatch_batches) == (True, False, False)
    assert accelerator.non_blocking is True and accelerator.use_seedable_sampler is False
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    assert (loader.shard_sampler.split_batches, loader.shard_sampler.even_batches) == (True, False)
    accelerator.even_batches = True  # settable, as in Accelerate; used by the next prepare()
    assert (
        config.even_batches is True
        and accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4)).shard_sampler.even_batches
        is True
    )
    with pytest.raises(TypeError, match="Accelerator.even_batches must be True or False"):
        accelerator.even_batches = "no"
    # The direct arguments still work alone.
    direct = Accelerator(split_batches=True, even_batches=False)
    assert (direct.split_batches, direct.even_batches) == (True, False)
    assert (Accelerator().split_batches, Accelerator().even_batches) == (False, True)


def _order(accelerator: Accelerator, epochs: int = 2) -> list[list[int]]:
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True))
    return [[int(i) for (b,) in loader for i in b] for _ in range(epochs)]


def test_data_seed_fixes_the_shuffled_order():
    torch.manual_seed(1)
    a = _order(Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=7, use_seedable_sampler=True)))
    torch.manual_seed(2)  # another global seed: the order is the data seed's
    b = _order(Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=7)))
    c = _order(Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=8)))
    assert a == b and a != c
    assert a[0] != a[1] and sorted(a[0]) == list(range(12))  # a new order each epoch
    assert b[1] == c[0]  # epoch e shuffles with data_seed + e


def test_dataloader_configuration_refusals():
    assert DataLoaderConfiguration(dispatch_batches=True).dispatch_batches is True  # no longer refused
    with pytest.raises(ValueError, match="use_stateful_dataloader=True is not supported by hasten"):
        DataLoaderConfiguration(use_stateful_dataloader=True)
    with pytest.raises(TypeError, match="DataLoaderConfiguration.split_batches must be True or False"):
        DataLoaderConfiguration(split_batches=1)
    with pytest.raises(ValueError, match="DataLoaderConfiguration.data_seed must be >= 0"):
        DataLoaderConfiguration(data_seed=-1)
    with pytest.raises(ValueError, match="got dataloader_config and split_batches=True; set split_batches in the Data"):
        Accelerator(split_batches=True, dataloader_config=DataLoaderConfiguration())
    with pytest.raises(ValueError, match="split_batches=False, even_batches=True; set split_batches, even_batches"):
        Accelerator(split_batches=False, even_batches=True, dataloader_config=DataLoaderConfiguration())
    with pytest.raises(TypeError, match="dataloader_config must be a DataLoaderConfiguration"):
        Accelerator(dataloader_config={"split_batches": True})


# ---------------------------------------------------------------------- small methods


def test_get_state_dict():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    sd = accelerator.get_state_dict(model)
    assert sorted(sd) == ["bias", "weight"] and torch.equal(sd["weight"], model.weight)
    assert sorted(accelerator.get_state_dict(model, unwrap=False)) == ["bias", "weight"]  # no DDP on one process


def test_save_and_load_state_pre_hooks(tmp_path):
    """A save hook takes one model's weights out and writes them itself; a load hook loads them back."""
    accelerator = Accelerator()
    set_seed(0)
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    first, second = accelerator.prepare(first, second)
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (models, [sorted(w) for w in weights], output_dir)
        torch.save(weights.pop(0), os.path.join(output_dir, "first.pt"))  # saved by the hook, not by save_state

    def load_hook(models, input_dir):
        seen["load"] = (list(models), input_dir)
        models.pop(0).load_state_dict(torch.load(os.path.join(input_dir, "first.pt")))

    save_handle = accelerator.register_save_state_pre_hook(save_hook)
    load_handle = accelerator.register_load_state_pre_hook(load_hook)
    assert isinstance(save_handle, torch.utils.hooks.RemovableHandle)
    target = accelerator.save_state(tmp_path / "ckpt")
    models, weight_keys, written_to = seen["save"]
    assert models == [first, second] and weight_keys == [["bias", "weight"], ["bias", "weight"]]
    assert os.path.dirname(written_to) == str(tmp_path) and written_to != target  # the temporary directory...
    assert os.path.isfile(os.path.join(target, "first.pt"))  # ...renamed into place with the hook's file
    assert sorted(f for f in os.listdir(target) if f.startswith("model")) == ["model.safetensors"]  # second only

    saved = {
        k: v.clone() for k, v in {**first.state_dict(), **{f"s.{k}": v for k, v in second.state_dict().items()}}.items()
    }
    with torch.no_grad():
        first.weight.zero_()
        second.weight.zero_()
    accelerator.load_state(target)
    assert seen["load"] == ([first, second], target)
    assert torch.equal(first.weight, saved["weight"]) and torch.equal(second.weight, saved["s.weight"])

    # Without the load hook, the checkpoint's one set of weights does not fit two models: a clear error.
    load_handle.remove()
    with pytest.raises(ValueError, match=r"holds the weights of 1 model\(s\), but 2 are left to restore"):
        accelerator.load_state(target)
    save_handle.remove()
    seen.clear()
    accelerator.save_state(tmp_path / "plain")
    assert "save" not in seen
    with pytest.raises(TypeError, match="register_save_state_pre_hook.hook must be a callable"):
        accelerator.register_save_state_pre_hook("print")


def test_trigger_on_one_process():
    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False  # lowered once seen


def test_run_on_decorators_on_one_process():
    accelerator = Accelerator()

    @accelerator.on_process(process_index=3)
    def everywhere_on_one_process():
        return "ran"

    assert everywhere_on_one_process() == "ran"  # one process: every index runs, as in Accelerate
    assert accelerator.on_last_process(lambda: 1)() == 1
    assert accelerator.on_local_process(lambda: 2, local_process_index=0)() == 2
    with pytest.raises(TypeError, match="process_index is required"):
        accelerator.on_process(lambda: 0)
    with pytest.raises(ValueError, match="on_local_process.local_process_index must be >= 0, got -1"):
        accelerator.on_local_process(local_process_index=-1)
    with accelerator.join_uneven_inputs([], even_batches=False):  # one process: nothing to join
        pass


# ---------------------------------------------------------------------- 2 processes, one launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    proc = launch("--num_processes", "2", SCRIPTS / "parity_checks.py", out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, read_ranks(out, 2)


def test_logger_main_process_only_and_in_order(ranks):
    out, _ = ranks
    lines = (out / "log.txt").read_text().splitlines()
    # Before the barrier the two processes write at the same time: only rank 0's own order holds.
    assert sorted(lines[:3]) == ["everyone: 0", "everyone: 1", "main only from 0"]
    assert lines.index("main only from 0") < lines.index("everyone: 0")
    assert lines[3:] == ["in order: 0", "in order: 1"] * 3


def test_trackers_log_on_the_main_process_only(ranks):
    out, (rank0, rank1) = ranks
    assert rank0["trackers"]["active"] == ["tensorboard", "main_only", "everywhere"]
    assert rank1["trackers"]["active"] == ["everywhere"]
    assert rank0["trackers"]["tensorboard_type"] == "TensorBoardTracker"
    assert rank1["trackers"]["tensorboard_type"] == "GeneralTracker"  # a do-nothing tracker on rank 1
    assert rank0["trackers"]["main_only_after_finish"] == ["start", "config", "log 0", "finish"]
    assert rank1["trackers"]["main_only_after_finish"] == []
    for r, res in enumerate((rank0, rank1)):
        assert res["trackers"]["everywhere_calls"] == ["start", "config", f"log {r}", "finish"]
    # One event file, written by rank 0, holding rank 0's value only.
    files = list((out / "logs" / "exp").glob("events.out.tfevents.*"))
    assert len(files) == 1
    from test_tracking import read_events

    assert [(e.step, e.value) for e in read_events(out / "logs" / "exp").Scalars("rank")] == [(0, 0.0)]


def test_sync_each_batch_all_reduces_every_micro_step(ranks):
    for res in ranks[1]:
        on, off = res["sync_each_batch"]["on"], res["sync_each_batch"]["off"]
        assert on["sync_gradients"] is False and off["sync_gradients"] is False  # no optimizer step yet
        assert on["ranks_agree"] is True  # all-reduced although the cycle goes on
        assert off["ranks_agree"] is False  # no_sync: each rank keeps its own gradients


def test_dataloader_configuration_splits_batches_across_processes(ranks):
    for r, res in enumerate(ranks[1]):
        # 10 samples, batch_size=4, split in two: parts of 2; the last batch (2 samples) gives 1 each.
        assert res["split"] == [[4 * b + 2 * r, 4 * b + 2 * r + 1] for b in range(2)] + [[8 + r]]


def test_trigger_raised_by_one_rank_is_seen_by_all(ranks):
    for res in ranks[1]:
        assert res["trigger"] == [False, True, False]


def test_run_on_decorators(ranks):
    rank0, rank1 = ranks[1]
    assert rank0["on_process"] == [None, 0, None, None, 0]
    assert rank1["on_process"] == ["ran on 1", None, 1, 1, None]


def test_join_uneven_inputs(ranks):
    rank0, rank1 = ranks[1]
    assert (rank0["join"]["batches"], rank1["join"]["batches"]) == (2, 1)  # uneven, and nobody hung
    for res in (rank0, rank1):
        assert res["join"]["weights_agree"]  # Join hands the last joiner's model to every rank
        assert res["join"]["even_batches_after"] is True  # the override ended with the block
        assert res["join"]["batches_after"] == 2
        assert res["join"]["wrapped_keys"] == ["module.bias", "module.weight"]
        assert res["join"]["keys"] == ["bias", "weight"]


def test_evaluation_mode_leaves_ddp_out_and_gather_for_metrics_keyword(ranks):
    for res in ranks[1]:
        assert res["evaluation_mode"] == ["Linear", "DistributedDataParallel"]
        assert res["gather_for_metrics"] == [0, 1]


def test_free_memory_takes_objects_and_returns_nones():
    accelerator = Accelerator()
    model, optimizer, loader = _prepared(accelerator)
    model, optimizer = accelerator.free_memory(model, optimizer)
    assert (model, optimizer) == (None, None)
    assert accelerator._models == [] and accelerator._optimizers == [] and accelerator.step == 0
    assert accelerator.clear() == []


# ---------------------------------------------------------------------- an Accelerate script, import changed


def _run_accelerate_style(tmp_path, library: str):
    script = (SCRIPTS / "accelerate_style_train.py").read_text()
    if library == "hasten":
        script = script.replace("from accelerate", "from hasten")
    path = tmp_path / f"train_{library}.py"
    path.write_text(script)
    out = tmp_path / library
    proc = subprocess.run(
        [sys.executable, str(path), str(out)], env=launch_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    from test_tracking import read_events

    events = read_events(out / "run")
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    lrs = [e.value for e in events.Scalars("lr")]
    return out, losses, lrs, torch.load(out / "final.pt")


def test_an_accelerate_script_runs_with_only_the_import_changed(tmp_path):
    pytest.importorskip("tensorboard", reason="the script logs to TensorBoard")
    out, losses, lrs, final = _run_accelerate_style(tmp_path, "hasten")
    assert [s for s, _ in losses] == list(range(12))  # 3 epochs of 8 batches, 2 per optimizer step
    assert lrs == pytest.approx([0.1] * 2 + [0.05] * 3 + [0.025] * 3 + [0.0125] * 3 + [0.00625])
    assert sorted(os.listdir(out / "checkpoints")) == [".hasten-lock", "checkpoint_1", "checkpoint_2"]  # total_limit=2
    assert final["predictions"].shape == (64, 1)
    if importlib.util.find_spec("accelerate") is None:
        return
    # The same script with Accelerate itself: the same losses, learning rates and final weights.
    _, ref_losses, ref_lrs, ref_final = _run_accelerate_style(tmp_path, "accelerate")
    assert [s for s, _ in ref_losses] == [s for s, _ in losses]
    assert ref_lrs == pytest.approx(lrs)
    assert [v for _, v in ref_losses] == pytest.approx([v for _, v in losses], rel=1e-5)
    for name, tensor in final["weights"].items():
        torch.testing.assert_close(tensor, ref_final["weights"][name])
    torch.testing.assert_close(final["predictions"], ref_final["predictions"])
