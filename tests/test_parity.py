"""Accelerate's API beyond the core: ProjectConfiguration, GradientAccumulationPlugin,
DataLoaderConfiguration and the small Accelerator methods; the 2-process checks (trackers,
sync_each_batch, ...) share one launch of scripts/parity_checks.py."""

from __future__ import annotations

import os

import pytest
import torch
from launch_utils import SCRIPTS, launch, read_ranks
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from hasten.rng import set_seed


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
        False, None, 0, False)
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
    assert sorted(os.listdir(root)) == ["checkpoint_4", "checkpoint_5"]  # the configuration's total_limit
    accelerator.save_state(total_limit=1)  # the call's own limit wins
    assert sorted(os.listdir(root)) == ["checkpoint_6"] and accelerator.save_iteration == 7
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
    running = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False))
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


def test_adjust_scheduler_counts_micro_steps():
    # 5 batches, cycles of 2, 2 and 1 (the dataloader's end): 3 optimizer steps.
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=2), 5) == (5, 3)  # one per batch
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False), 5) == (3, 3)
    assert _scheduler_steps(None, 5, gradient_accumulation_steps=2) == (3, 3)  # hasten's rule without the plugin
    assert _scheduler_steps(GradientAccumulationPlugin(num_steps=1), 5) == (5, 5)


def test_plugin_and_steps_together_is_an_error():
    with pytest.raises(ValueError, match="both gradient_accumulation_steps=2 and gradient_accumulation_plugin=.*pass one"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert Accelerator(gradient_accumulation_steps=1, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4)
                       ).gradient_accumulation_steps == 4  # as Accelerate: 1 is its default
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
    assert config.even_batches is True and accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4)
                                                                 ).shard_sampler.even_batches is True
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
    with pytest.raises(ValueError, match="dispatch_batches=True is not supported by hasten"):
        DataLoaderConfiguration(dispatch_batches=True)
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


# ---------------------------------------------------------------------- 2 processes, one launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    proc = launch("--num_processes", "2", SCRIPTS / "parity_checks.py", out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, read_ranks(out, 2)


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
