"""Live fault tolerance on torchft: the only consumer of ``FaultToleranceKwargs``.

Built once at ``Accelerator(...)`` (:func:`start`): torchft's ``Manager`` on a reconfigurable
``ProcessGroupGloo`` that joins this process to the same rank of every other replica group, as
the lighthouse's quorum says. Then, as torchft's own wrappers do (``torchft/ddp.py``,
``torchft/optim.py``) and torchtitan's ``experiments/torchft`` wires them:

* the model (:class:`FaultTolerantDDPStrategy`) is torch's DDP whose communication hook averages
  each gradient bucket inside the group (the group's own process group, when it has several
  processes) and then across the groups through ``Manager.allreduce``; buckets are never rebuilt
  (``find_unused_parameters=True``, as torchft's DDP), so a rejoining group's match its peers';
* the optimizer (:class:`CommitGate`) starts the quorum at ``zero_grad`` (or, for a loop that
  steps before it zeroes, at the first gradient reduction) and steps only if
  ``Manager.should_commit()`` says the step is committed;
* the state a rejoining group receives (``register_state_dict_fn``): every prepared model,
  optimizer and scheduler, and the manager's step;
* the data loader shards by (replica group, number of groups, rank in group): :func:`data_view`.

With ``semi_sync="local_sgd"`` the model is plain DDP inside the group and torchft's ``LocalSGD``
(its optimizer hooks) averages the weights across groups every ``sync_every`` steps instead.

``accelerator.step`` is the manager's committed step (a healed group adopts its peers').
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hasten.settings import environment as env
from hasten.settings.fault_tolerance import FaultToleranceKwargs
from hasten.settings.parallelism import DataParallelView
from hasten.strategies.ddp import DDPStrategy, apply_ddp
from hasten.strategies.parallelize import DDPPlan
from hasten.training.compile import unwrap_compiled

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.settings.handlers import DistributedDataParallelKwargs
    from hasten.training.compile import Compiler
    from hasten.training.precision import Precision
    from hasten.training.registry import PreparedObjects

INSTALL_HINT = "pip install 'hasten[ft]' (torchft==0.2.0)"


class FaultTolerance:
    """torchft's ``Manager`` for this process, and the quorum/commit bookkeeping of one step."""

    def __init__(self, handler: FaultToleranceKwargs, state: ProcessState, registry: PreparedObjects) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as e:
            raise ImportError(f"FaultToleranceKwargs needs torchft: {INSTALL_HINT} ({e})") from None
        self.handler = handler
        self.registry = registry
        self.group_rank, self.group_size = state.process_index, state.num_processes
        self._store = None
        if state.use_distributed:  # torch.distributed.run's agent store holds the group's manager address
            store_addr, store_port = env.require(env.MASTER_ADDR), int(env.require(env.MASTER_PORT))
        else:  # one process in the group: a store of its own (torch's TCPStore), as torchrun would give
            from torch.distributed import TCPStore

            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self._store.port
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=handler.timeout),
                load_state_dict=None,
                state_dict=None,
                use_async_quorum=True,
                rank=self.group_rank,
                world_size=self.group_size,
                store_addr=store_addr,
                store_port=store_port,
                **handler.manager_kwargs(),
            )
        except RuntimeError as e:
            if "connect" not in str(e):
                raise
            raise ConnectionError(
                f"FaultToleranceKwargs.lighthouse {handler.lighthouse!r} cannot be reached within "
                f"connect_timeout={handler.connect_timeout.total_seconds():g} s: is `hasten lighthouse` "
                f"running there? ({e})"
            ) from None
        self.manager.register_state_dict_fn("hasten", self._load_state, self._state)
        self._quorum_pending = False

    # ---------------------------------------------------------------- one step
    def start_quorum(self) -> None:
        """The quorum of the coming step, unless it is started already (torchft's ``start_quorum``:
        reconfigures the process group and, where this group is behind, heals it)."""
        if not self._quorum_pending:
            self.manager.start_quorum()
            self._quorum_pending = True

    def commit(self) -> bool:
        """Whether the step is committed (``Manager.should_commit``: every group's reduction
        succeeded and enough groups took part); the next step needs a new quorum."""
        self.start_quorum()
        self._quorum_pending = False
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """The committed step (the manager's, which a healed group takes from its peer)."""
        return self.manager.current_step()

    # ---------------------------------------------------------------- what a rejoining group receives
    def _state(self) -> dict[str, Any]:
        from hasten.strategies import unwrap_any

        return {
            "models": [unwrap_any(m).state_dict() for m in self.registry.models],
            "optimizers": [o.state_dict() for o in self.registry.optimizers],
            "schedulers": [s.state_dict() for s in self.registry.schedulers],
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        from hasten.strategies import unwrap_any

        with torch.no_grad():
            for model, sd in zip(self.registry.models, state["models"], strict=True):
                unwrap_any(model).load_state_dict(sd)
        for optimizer, sd in zip(self.registry.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(sd)
        for scheduler, sd in zip(self.registry.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(sd)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def start(
    handler: FaultToleranceKwargs | None,
    state: ProcessState,
    registry: PreparedObjects,
    fsdp_plugin: Any = None,
    parallelism_config: Any = None,
) -> FaultTolerance | None:
    """The Accelerator's fault tolerance: None without the handler, else torchft's Manager (the
    lighthouse reached now: an unreachable one is a ConnectionError naming it). FSDP and N-D
    meshes are refused first, by name."""
    if handler is None:
        return None
    if fsdp_plugin is not None or parallelism_config is not None:
        what = "fsdp_plugin" if fsdp_plugin is not None else "parallelism_config"
        raise ValueError(
            f"FaultToleranceKwargs with Accelerator({what}=...) is not supported: fault tolerance runs DDP inside "
            "each replica group and torchft's manager across groups; drop one of them"
        )
    if handler.semi_sync == "diloco":
        raise NotImplementedError(
            "FaultToleranceKwargs.semi_sync='diloco' is not implemented yet: use semi_sync='local_sgd' or None "
            "(a gradient all-reduce each step)"
        )
    return FaultTolerance(handler.resolved(), state, registry)


def data_view(ft: FaultTolerance | None, state: Any) -> Any:
    """The data pipeline's view: with fault tolerance, every rank of every replica group is one
    shard, ``group * group_size + rank`` of ``num_replica_groups * group_size`` (torchft's
    ``DistributedSampler`` numbering), so no two groups read the same batches."""
    if ft is None:
        return state
    groups, group = ft.handler.num_replica_groups, ft.handler.replica_group
    if groups == 1:
        return state
    return _GroupsView(state, state.num_processes * groups, group * state.num_processes + state.process_index)


class _GroupsView(DataParallelView):
    """Each process reads its own batches (the groups do not share any): no shared seeds."""

    shares_batches = False


# ---------------------------------------------------------------------------- the strategy
class FaultTolerantDDPStrategy(DDPStrategy):
    """DDP inside the replica group, torchft's manager across the groups, the commit gate on the optimizer."""

    def __init__(
        self,
        state: ProcessState,
        precision: Precision,
        ft: FaultTolerance,
        handler: DistributedDataParallelKwargs | None = None,
        compiler: Compiler | None = None,
    ) -> None:
        super().__init__(state, precision, handler, compiler)
        if self.handler.comm_hook.value != "no" or self.handler.comm_wrapper.value != "no":
            raise ValueError(
                "DistributedDataParallelKwargs.comm_hook/comm_wrapper cannot be combined with FaultToleranceKwargs: "
                "torchft's manager reduces the gradients across replica groups; drop the hook"
            )
        self.ft = ft
        self.plan = dataclasses.replace(self.plan, ddp=DDPPlan(self.handler, self.plan.ddp.device_ids))
        self._optimizers = 0
        self._local_sgd = ft.handler.semi_sync == "local_sgd"
        self._trained: torch.nn.Module | None = None  # the model LocalSGD averages
        self.local_sgd: Any = None  # torchft's LocalSGD, entered for good once the optimizer is prepared

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(unwrap_compiled(module), DistributedDataParallel):
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module
        if not self._local_sgd:
            return wrap_model(module, self.ft, self.plan.ddp)
        self._trained = module  # LocalSGD: plain DDP inside the group; the groups average the weights
        return apply_ddp(module, self.plan.ddp) if self.ft.group_size > 1 else module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self._optimizers:
            raise ValueError(
                "FaultToleranceKwargs trains one optimizer: each step commits once across replica groups "
                "(torchft's should_commit); put every parameter group into one optimizer"
            )
        self._optimizers += 1
        if not self._local_sgd:
            return CommitGate(self.ft, super().setup_optimizer(optimizer))
        if self._trained is None:
            raise ValueError("FaultToleranceKwargs(semi_sync='local_sgd'): prepare the model before its optimizer")
        from torchft.local_sgd import LocalSGD

        optimizer = super().setup_optimizer(optimizer)
        self.local_sgd = LocalSGD(self.ft.manager, self._trained, optimizer, self.ft.handler.sync_every).__enter__()
        return optimizer


def wrap_model(module: torch.nn.Module, ft: FaultTolerance, plan: DDPPlan) -> DistributedDataParallel:
    """torch's DDP on the group's process group (torchft's dummy one for a group of one process,
    which soaks up DDP's start-up broadcast, as torchft's own DDP), buckets never rebuilt, and the
    hook that reduces inside the group then across groups."""
    from torchft.process_group import ProcessGroupDummy

    group = dist.group.WORLD if ft.group_size > 1 else ProcessGroupDummy(0, 1)
    # find_unused_parameters: torchft's own DDP's choice (rebuilt buckets would differ in a rejoining group)
    return apply_ddp(module, plan, process_group=group, hook=(ft, _reduce_across_groups), find_unused_parameters=True)


def _reduce_across_groups(ft, bucket):  # type: ignore[no-untyped-def] - DDP checks real annotations, not strings
    """A bucket's gradients averaged over the group's processes, then over the replica groups
    (``Manager.allreduce``: a group that is healing sends zeros and receives the average).
    ``ft``: the FaultTolerance; ``bucket``: a ``dist.GradBucket``; returns a ``torch.futures.Future``."""
    buffer = bucket.buffer()
    if ft.group_size > 1:
        dist.all_reduce(buffer)
        buffer.div_(ft.group_size)
    ft.start_quorum()  # a loop that steps before it zeroes: the first step's quorum
    work = ft.manager.allreduce(buffer)
    future = work.get_future() if work.wait() else None  # a failed reduction: reported to the manager
    future = getattr(future, "_fut", future)  # torchft's DDP hook returns the managed future's own
    if future is None:  # the step will not commit: DDP gets the buffer as it is, and the step goes on
        future = torch.futures.Future()
        future.set_result(buffer)
    return future


class CommitGate(torch.optim.Optimizer):
    """torchft's ``OptimizerWrapper`` semantics: the quorum at ``zero_grad``, the commit at ``step``."""

    def __init__(self, ft: FaultTolerance, optimizer: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__: every attribute is the wrapped optimizer's.
        self.ft = ft
        self.optimizer = optimizer

    param_groups = property(lambda self: self.optimizer.param_groups)  # type: ignore[assignment]
    state = property(lambda self: self.optimizer.state)  # type: ignore[assignment]
    defaults = property(lambda self: self.optimizer.defaults)  # type: ignore[assignment]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ft.start_quorum()
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "FaultToleranceKwargs: optimizer.step(closure) is not supported (torchft's wrapper neither)"
            )
        if self.ft.commit():
            return self.optimizer.step()
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "ft"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"CommitGate({self.optimizer!r})"
