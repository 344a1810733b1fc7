"""hasten's fault tolerance under Ray Train's ``TorchftConfig`` (issue 60).

Ray starts torchft's lighthouse and makes every worker a replica group of its own; the
Accelerator takes the replica group, the number of groups and the lighthouse from Ray
(``FaultToleranceKwargs.resolved``, :mod:`hasten.settings.ray_torchft`), refuses a field set in
code that says otherwise, and turns fault tolerance on by itself there when no handler is given.

Fast: a stand-in for Ray Train's worker context (the module and attributes hasten reads, checked
against the installed Ray where it is installed). Slow (tests/scripts/ray_ft_train.py, one
``TorchTrainer.fit`` each, 2 CPU workers): no faults, the weights of DDP over both workers; worker
1 raising at step 5, Ray replaces it, the new worker heals from worker 0 and both finish equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from hasten import Accelerator, FaultToleranceKwargs  # noqa: E402
from hasten.settings import environment as env  # noqa: E402
from hasten.settings import ray_torchft  # noqa: E402
from hasten.settings.fault_tolerance import implied_by_ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ray_ft_train.py"
RAY_LIGHTHOUSE = "http://ray-head:29510"


def _ray_worker(monkeypatch, rank: int, size: int, replica_groups: bool = True) -> None:
    """This process as a Ray Train worker of rank ``rank`` of ``size``: the context module hasten
    reads, with a backend that has replica groups (TorchftConfig's) or not (TorchConfig's)."""
    backend = type("Backend", (), {"has_replica_groups": replica_groups})
    context = SimpleNamespace(
        get_world_rank=lambda: rank,
        get_world_size=lambda: size,
        train_run_context=SimpleNamespace(backend_config=SimpleNamespace(backend_cls=backend)),
    )
    module = types.ModuleType(ray_torchft.RAY_CONTEXT_MODULE)
    module.get_train_context = lambda: context
    monkeypatch.setitem(sys.modules, ray_torchft.RAY_CONTEXT_MODULE, module)
    monkeypatch.setenv(env.TORCHFT_LIGHTHOUSE, RAY_LIGHTHOUSE)
    for name in (env.HASTEN_FT_LIGHTHOUSE, env.HASTEN_FT_REPLICA_GROUP, env.HASTEN_FT_NUM_REPLICA_GROUPS):
        monkeypatch.delenv(name, raising=False)


def test_outside_ray_nothing_changes(monkeypatch):
    monkeypatch.delitem(sys.modules, ray_torchft.RAY_CONTEXT_MODULE, raising=False)
    assert ray_torchft.replica_group() is None and implied_by_ray() is None
    module = types.ModuleType(ray_torchft.RAY_CONTEXT_MODULE)  # Ray imported, but no worker (the driver)

    def no_context():
        raise RuntimeError("TrainContext has not been initialized.")

    module.get_train_context = no_context
    monkeypatch.setitem(sys.modules, ray_torchft.RAY_CONTEXT_MODULE, module)
    assert ray_torchft.replica_group() is None and implied_by_ray() is None


def test_a_plain_torch_config_is_not_fault_tolerant(monkeypatch):
    _ray_worker(monkeypatch, 1, 2, replica_groups=False)
    assert ray_torchft.replica_group() is None and implied_by_ray() is None
    assert FaultToleranceKwargs().resolved().replica_group == 0  # the launcher's defaults, not Ray's


def test_the_replica_group_and_lighthouse_come_from_ray(monkeypatch):
    _ray_worker(monkeypatch, 1, 3)
    assert ray_torchft.replica_group() == (1, 3, RAY_LIGHTHOUSE)
    got = FaultToleranceKwargs(min_replicas=2, semi_sync="diloco", sync_every=4).resolved()
    assert (got.replica_group, got.num_replica_groups, got.lighthouse) == (1, 3, RAY_LIGHTHOUSE)
    assert (got.min_replicas, got.semi_sync, got.sync_every) == (2, "diloco", 4)  # the rest is the user's
    agreeing = FaultToleranceKwargs(replica_group=1, num_replica_groups=3, lighthouse=RAY_LIGHTHOUSE).resolved()
    assert agreeing.replica_group == 1
    assert implied_by_ray() == FaultToleranceKwargs()  # on by itself, with the defaults


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"replica_group": 0}, "replica_group=0 disagrees with Ray Train's TorchftConfig, which set 1"),
        ({"num_replica_groups": 4}, "num_replica_groups=4 disagrees with Ray Train's TorchftConfig, which set 2"),
        (
            {"lighthouse": "http://elsewhere:1"},
            f"lighthouse='http://elsewhere:1' disagrees with Ray Train's TorchftConfig, which set '{RAY_LIGHTHOUSE}'",
        ),
    ],
)
def test_a_field_that_disagrees_with_ray_is_refused_naming_both(monkeypatch, kwargs, words):
    _ray_worker(monkeypatch, 1, 2)
    handler = FaultToleranceKwargs(**kwargs)
    with pytest.raises(ValueError, match="FaultToleranceKwargs") as caught:
        handler.resolved()
    assert words in str(caught.value) and "leave" in str(caught.value)


def test_more_min_replicas_than_ray_has_groups_is_refused(monkeypatch):
    _ray_worker(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="min_replicas=3 is more than num_replica_groups=2"):
        FaultToleranceKwargs(min_replicas=3).resolved()


def test_ray_without_its_lighthouse_is_an_error(monkeypatch):
    _ray_worker(monkeypatch, 0, 2)
    monkeypatch.delenv(env.TORCHFT_LIGHTHOUSE)
    with pytest.raises(RuntimeError, match="did not export TORCHFT_LIGHTHOUSE"):
        FaultToleranceKwargs().resolved()


def test_the_accelerator_turns_fault_tolerance_on_by_itself(monkeypatch):
    """No handler given: the Accelerator takes the default one, seen by the refusal that comes
    before the lighthouse is reached (FSDP with fault tolerance)."""
    from hasten import FullyShardedDataParallelPlugin

    _ray_worker(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match=r"FaultToleranceKwargs with Accelerator\(fsdp_plugin=...\) is not supported"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def test_the_installed_ray_has_what_hasten_reads():
    """The stand-in above is Ray 2.60's: the context module and its function, the run context's
    backend_config, TorchftConfig's backend with replica groups, TorchConfig's without, and the
    variable Ray exports the lighthouse's address in."""
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'hasten[ray]')")
    import dataclasses
    import importlib

    from ray.train.torch import TorchConfig
    from ray.train.v2._internal.constants import TORCHFT_LIGHTHOUSE_ADDR_ENV_VAR
    from ray.train.v2.torch.torchft_config import TorchftConfig

    module = importlib.import_module(ray_torchft.RAY_CONTEXT_MODULE)
    assert callable(module.get_train_context)
    assert "backend_config" in {f.name for f in dataclasses.fields(module.TrainRunContext)}
    assert TorchftConfig(lighthouse_kwargs={}).backend_cls.has_replica_groups is True
    assert getattr(TorchConfig().backend_cls, "has_replica_groups", False) is False
    assert TORCHFT_LIGHTHOUSE_ADDR_ENV_VAR == env.TORCHFT_LIGHTHOUSE


# ---------------------------------------------------------------------------- Ray runs (slow)
def _fit(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'hasten[ray]'; make test-slow)")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_", "TORCHFT_"))}
    keep = {
        k: v for k, v in keep.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    keep.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), mode]
    proc = subprocess.run(cmd, cwd=tmp_path, env=keep, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0 and "RAY FT DONE" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def _result(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def _reference(steps: int) -> list[float]:
    """The script's model and optimizer in a plain loop over batches of 8 (both workers' batches
    of 4: DDP's average over the 2 processes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    for k in range(steps):
        rows = list(range((k % 8) * 8, (k % 8) * 8 + 8))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return torch.cat([model.weight.detach().flatten(), model.bias.detach().flatten()]).tolist()


@pytest.mark.slow
def test_two_ray_workers_without_faults_train_as_ddp_over_both(tmp_path):
    """FaultToleranceKwargs(min_replicas=2, init_sync=False) in each worker: Ray's replica group
    is taken (workers 0 and 1 of 2, Ray's lighthouse), the workers read disjoint halves, and after
    16 committed steps the weights are a plain loop's over batches of 8, equal on both."""
    _fit(tmp_path, "ddp")
    a, b = _result(tmp_path, "worker0_a"), _result(tmp_path, "worker1_a")
    assert a["group"][:2] == [0, 2] and b["group"][:2] == [1, 2] and a["group"][2] == b["group"][2]
    assert a["group"][2].startswith("http://")
    assert a["steps"] == b["steps"] == list(range(1, 17))
    assert a["by_step"] == b["by_step"]
    assert not set(a["seen"]) & set(b["seen"]) and len(set(a["seen"]) | set(b["seen"])) == 64
    assert max(abs(p - q) for p, q in zip(a["final"], _reference(16), strict=True)) < 1e-5


@pytest.mark.slow
def test_a_failed_ray_worker_is_replaced_heals_and_both_finish(tmp_path):
    """No handler (on by itself under TorchftConfig). Worker 1 raises at its committed step 5; Ray
    replaces only its replica group while worker 0 commits on alone; the new worker 1 is group 1
    again, heals from worker 0 (its first committed step is its peer's, not 1), and both end at
    the step it named, with equal weights at every step both committed."""
    _fit(tmp_path, "fault")
    a, b = _result(tmp_path, "worker0_a"), _result(tmp_path, "worker1_b")
    target = int((tmp_path / "target").read_text())
    assert (tmp_path / "failed").exists()
    assert b["group"] == [1, 2, a["group"][2]]
    assert a["steps"][-1] == b["steps"][-1] == target
    assert b["steps"][0] > 6, b["steps"]  # healed to its peer's step, past the failure
    assert b["steps"] == list(range(b["steps"][0], target + 1))
    assert all(a["by_step"][k] == b["by_step"][k] for k in b["by_step"])
    assert a["final"] == b["final"]
