"""Ray Train's ``TorchftConfig``: the replica group Ray made this worker, read from Ray.

With ``TorchTrainer(..., torch_config=TorchftConfig(...))`` Ray starts torchft's lighthouse,
exports its address as ``TORCHFT_LIGHTHOUSE`` in every worker, makes every worker a replica group
of its own (Ray 2.60's ``replica_group_size=1``: the group is the worker's world rank, the number
of groups Ray's world size), gives each group a process group of its own, and on a failure
replaces only the failed group. :func:`replica_group` reads that from the worker's Ray Train
context; ``FaultToleranceKwargs.resolved`` takes it (:mod:`hasten.settings.fault_tolerance`).

Ray is never imported here: a process that has not imported Ray Train's context is no Ray Train
worker. Its ``TrainRunContext.backend_config`` (Ray 2.60) is how a worker tells ``TorchftConfig``
(its backend has replica groups) from the plain ``TorchConfig``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from hasten.settings import environment as env

#: the module of Ray Train v2's per-worker context (imported in every Ray Train worker)
RAY_CONTEXT_MODULE = "ray.train.v2._internal.execution.context"


class RayReplicaGroup(NamedTuple):
    """This worker's replica group as Ray made it: its number, how many there are, the lighthouse."""

    group: int
    groups: int
    lighthouse: str


def replica_group() -> RayReplicaGroup | None:
    """This worker's replica group under Ray Train's ``TorchftConfig``; None anywhere else (no Ray
    Train context in this process, or a run with another ``torch_config``)."""
    context = _torchft_context()
    if context is None:
        return None
    rank, size = int(context.get_world_rank()), int(context.get_world_size())
    per_group = _group_size()
    if size % per_group:
        raise RuntimeError(
            f"Ray Train's TorchftConfig: the world of {size} workers is not a whole number of replica groups of "
            f"{per_group} (the process group Ray made this worker)"
        )
    lighthouse = env.get(env.TORCHFT_LIGHTHOUSE)
    if not lighthouse:
        raise RuntimeError(
            f"Ray Train's TorchftConfig did not export {env.TORCHFT_LIGHTHOUSE} in this worker: its lighthouse "
            "is unknown (is Ray's TorchftConfig backend started?)"
        )
    return RayReplicaGroup(rank // per_group, size // per_group, lighthouse)


def _torchft_context() -> Any:
    """Ray Train's context of this worker where its run's backend has replica groups, else None."""
    module = sys.modules.get(RAY_CONTEXT_MODULE)
    if module is None:
        return None
    try:
        context = module.get_train_context()
        backend = context.train_run_context.backend_config.backend_cls
    except Exception:  # noqa: BLE001 - not a Ray Train worker (the driver), or another Ray: no TorchftConfig
        return None
    return context if getattr(backend, "has_replica_groups", False) is True else None


def _group_size() -> int:
    """The processes of one replica group: those of the process group Ray made (one in Ray 2.60)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1
