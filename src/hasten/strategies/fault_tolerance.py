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
  optimizer and scheduler, the registered objects, the GradScaler, the RNG states (Python,
  NumPy, torch's CPU and CUDA generators, as its peer had them when the step's quorum started),
  and the manager's step;
* the data loader shards by (replica group, number of groups, rank in group): :func:`data_view`.

With ``semi_sync`` the model is plain DDP inside the group and torchft's ``LocalSGD`` or
``DiLoCo`` (their optimizer hooks) meet the other groups every ``sync_every`` steps instead:
LocalSGD averages the weights, DiLoCo the pseudo-gradients, which an outer SGD steps with
(Streaming DiLoCo: the parameters cut into ``fragments``, synced in turn, :func:`split_fragments`).

``accelerator.step`` is the manager's committed step (a healed group adopts its peers').
``save_state`` keeps it (:meth:`FaultTolerance.state_dict`: the manager's step and batches, the
position in the sync cycle and DiLoCo's outer state), so a resume after a full stop is exact.
It writes once per job (``checkpoint/replica_groups.py``): the groups tell each other their
folders and each process's dataloader positions and RNG states over torchft's process group
(:meth:`FaultTolerance.exchange`); the lowest group of those given one folder writes it, with
every group's states, and each group takes its own back at ``load_state``.
fp16: the GradScaler's skip is decided on the gradients averaged across groups, the same on every
group (:class:`CommitGate`); with ``semi_sync`` it would not be, and is refused.
"""

from __future__ import annotations

import dataclasses
import io
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hasten.distributed import ops
from hasten.settings import environment as env
from hasten.settings.fault_tolerance import FaultToleranceKwargs
from hasten.settings.parallelism import DataParallelView
from hasten.strategies.ddp import DDPStrategy, apply_ddp
from hasten.strategies.parallelize import DDPPlan
from hasten.training.compile import unwrap_compiled
from hasten.training.rng import capture_rng_state, restore_rng_state

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
        self.precision: Precision | None = None  # the strategy's, for the GradScaler a rejoining group receives
        self.semi: Any = None  # torchft's LocalSGD or DiLoCo, with semi_sync
        self._store = None
        if state.use_distributed:  # torch.distributed.run's agent store holds the group's manager address
            store_addr, store_port = env.require(env.MASTER_ADDR), int(env.require(env.MASTER_PORT))
        else:  # one process in the group: a store of its own (torch's TCPStore), as torchrun would give
            from torch.distributed import TCPStore

            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self._store.port

        def build() -> Any:
            return Manager(
                pg=ProcessGroupGloo(timeout=handler.timeout),
                load_state_dict=None,
                state_dict=None,
                rank=self.group_rank,
                world_size=self.group_size,
                store_addr=store_addr,
                store_port=store_port,
                **handler.manager_kwargs(),
            )

        self.manager = self._build_manager(build)
        self.manager.register_state_dict_fn("hasten", self._load_state, self._state)
        self._quorum_pending = False
        self._rng_at_quorum: dict[str, Any] | None = None  # this process's RNG states when the step's quorum started
        #: while the save writes: every replica group's state of this process's rank (``fault_tolerance_groups_N.pt``)
        self.saved_groups: dict[int, dict[str, Any]] | None = None

    def _build_manager(self, build: Any) -> Any:
        """torchft's Manager, rank 0 of the group first: it starts the group's manager server,
        which reaches the lighthouse; the other ranks read its address from the group's store,
        where they would wait for ever had it failed. So rank 0 tells them how it went, and a
        lighthouse that cannot be reached is the same ConnectionError on every rank."""
        if self.group_size == 1:
            return self._reach(build)
        manager, failure = None, None
        if self.group_rank == 0:
            try:
                manager = self._reach(build)
            except Exception as e:  # noqa: BLE001 - told to every rank of the group, then raised
                failure = e
        told = ops.from_main(self.group_rank == 0, None if failure is None else (type(failure).__name__, str(failure)))
        if failure is not None:
            raise failure
        if told is not None:
            kind, message = told
            error = ConnectionError if kind == "ConnectionError" else RuntimeError
            raise error(f"{message} (raised on rank 0 of replica group {self.handler.replica_group})")
        return manager if manager is not None else self._reach(build)

    def _reach(self, build: Any) -> Any:
        try:
            return build()
        except RuntimeError as e:
            if "connect" not in str(e):
                raise
            handler = self.handler
            raise ConnectionError(
                f"FaultToleranceKwargs.lighthouse {handler.lighthouse!r} cannot be reached within "
                f"connect_timeout={handler.connect_timeout.total_seconds():g} s: is `hasten lighthouse` "
                f"running there? ({e})"
            ) from None

    # ---------------------------------------------------------------- one step
    def start_quorum(self) -> None:
        """The quorum of the coming step, unless it is started already (torchft's ``start_quorum``:
        reconfigures the process group and, where this group is behind, heals it)."""
        if not self._quorum_pending:
            # What a peer healing in this quorum receives: the generators now, in the main thread, at
            # the step's start (the quorum thread sends them while this one may be drawing already).
            self._rng_at_quorum = capture_rng_state()
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
    def send_parts(self) -> tuple[list[Any], list[Any]]:
        """The models' and optimizers' states a rejoining group receives: whole state dicts here; the
        FSDP strategy (``fault_tolerance_fsdp.py``) sends each rank's shards instead."""
        from hasten.strategies import unwrap_any

        registry = self.registry
        return [unwrap_any(m).state_dict() for m in registry.models], [o.state_dict() for o in registry.optimizers]

    def receive_parts(self, models: list[Any], optimizers: list[Any]) -> None:
        """Put back what ``send_parts`` of the same rank of a peer group sent."""
        from hasten.strategies import unwrap_any

        registry = self.registry
        with torch.no_grad():
            for model, sd in zip(registry.models, models, strict=True):
                unwrap_any(model).load_state_dict(sd)
        for optimizer, sd in zip(registry.optimizers, optimizers, strict=True):
            optimizer.load_state_dict(sd)

    def _state(self) -> dict[str, Any]:
        registry = self.registry
        models, optimizers = self.send_parts()
        return {
            "models": models,
            "optimizers": optimizers,
            "schedulers": [s.state_dict() for s in registry.schedulers],
            "custom": [o.state_dict() for o in registry.custom_objects],
            "scaler": self.precision.state_dict() if self.precision is not None else {},
            # with semi_sync torchft starts the quorum itself, and this thread waits for it meanwhile
            "rng": self._rng_at_quorum if self._rng_at_quorum is not None else capture_rng_state(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        registry = self.registry
        self.receive_parts(state["models"], state["optimizers"])
        for scheduler, sd in zip(registry.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(sd)
        for obj, sd in zip(registry.custom_objects, state["custom"], strict=True):
            obj.load_state_dict(sd)
        if self.precision is not None:
            self.precision.load_state_dict(state["scaler"])
        restore_rng_state(state["rng"], "the state this replica group received from its peer (torchft's heal)")

    # ---------------------------------------------------------------- what save_state keeps
    def state_dict(self) -> dict[str, Any]:
        """What ``save_state`` writes besides the prepared objects: the manager's committed step
        and batches, and with ``semi_sync`` the position in the sync cycle and the states torchft
        registered for healing (DiLoCo's outer optimizers and last synced weights, per fragment)."""
        out: dict[str, Any] = {"manager": self.manager.state_dict(), "semi_sync": self.handler.semi_sync}
        if self.semi is not None:
            out["local_step"] = self.semi._local_step  # torchft 0.2.0's own counter (pinned)
            user = self.manager._user_state_dicts  # the fragments' save functions (torchft 0.2.0)
            out["torchft"] = {key: fn() for key, fn in user.items() if key != "hasten"}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back ``state_dict()``'s (``load_state``); refused where the checkpoint's semi_sync is another."""
        if state.get("semi_sync") != self.handler.semi_sync:
            raise ValueError(
                f"the checkpoint was saved with FaultToleranceKwargs(semi_sync={state.get('semi_sync')!r}), this run "
                f"has semi_sync={self.handler.semi_sync!r}: its sync cycle cannot be resumed exactly"
            )
        self.manager.load_state_dict(state["manager"])
        if self.semi is not None:
            self.semi._local_step = int(state["local_step"])
            for key, sd in state["torchft"].items():
                self.manager._load_state_dict_fns[key](sd)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ---------------------------------------------------------------- save_state (checkpoint/replica_groups.py)
    def check_savable(self) -> None:
        """Refuse a ``save_state`` that could not be resumed exactly: with ``fragment_sync_delay`` a
        fragment's all-reduce started at inner step ``sync_every / fragments - delay`` is in flight until the
        sync, and a checkpoint cannot hold it (torchft 0.2.0's ``_allreduce_work``)."""
        fragments = getattr(self.semi, "_fragments", ())
        if any(getattr(f, "_allreduce_work", None) for f in fragments):
            h, period = self.handler, self.semi._sync_every  # torchft's: sync_every / fragments inner steps
            raise ValueError(
                f"save_state at inner step {self.semi._local_step} of a fragment's {period}: with FaultToleranceKwargs("
                f"fragment_sync_delay={h.fragment_sync_delay}) the fragment's all-reduce is in flight from inner step "
                f"{period - h.fragment_sync_delay} to the sync, and a checkpoint cannot hold it; nothing was written. "
                f"Save at inner steps 0 to {period - h.fragment_sync_delay - 1} (optimizer steps since the start "
                f"modulo {period}, while no group fails)"
            )

    def exchange_is_safe(self) -> bool:
        """Whether torchft's process group joins only groups at this committed step: that of its
        quorum (semi_sync, or no quorum started since the commit), or one started since that no
        group joined (as many in it as are at the step). Before any step: the first quorum, now."""
        manager = self.manager
        if manager._quorum_future is None and self.handler.semi_sync is None:  # torchft 0.2.0's (pinned): no quorum
            self.start_quorum()
        elif manager._quorum_future is None:
            manager.start_quorum()
        manager.wait_quorum()
        if self.handler.semi_sync is not None or not self._quorum_pending:
            return True
        return manager._pg.size() == manager.num_participants()

    def exchange(self, mine: Any) -> list[Any]:
        """``mine`` (torch-serialisable, ``weights_only``) from this process to rank r of every group
        in torchft's process group (its all-gather: ``manager._pg``, torchft 0.2.0's, pinned), and
        theirs, in the group's order there. A failure (a group died meanwhile) is reported to the
        manager (the step under way does not commit) and raised."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        pg = self.manager._pg
        try:
            buffer = io.BytesIO()
            torch.save(mine, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
            pg.allgather([sizes], [torch.tensor([data.numel()])], AllgatherOptions()).wait()
            longest = max(int(n) for n in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: data.numel()] = data
            out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
            pg.allgather([out], [padded], AllgatherOptions()).wait()
        except Exception as e:
            self.manager.report_error(e)
            raise
        return [
            torch.load(io.BytesIO(o[: int(n)].numpy().tobytes()), weights_only=True)
            for o, n in zip(out, sizes, strict=True)
        ]


def start(
    handler: FaultToleranceKwargs | None,
    state: ProcessState,
    registry: PreparedObjects,
    fsdp_plugin: Any = None,
    parallelism_config: Any = None,
) -> FaultTolerance | None:
    """The Accelerator's fault tolerance: None without the handler, else torchft's Manager (the
    lighthouse reached now: an unreachable one is a ConnectionError naming it). What does not run
    inside a replica group (semi_sync with fp16 or FSDP, tp/cp/sp/pp/ep, FSDP over one process) is
    refused first, by name."""
    if handler is None:
        return None
    if handler.semi_sync is not None and getattr(state, "mixed_precision", "no") == "fp16":
        raise ValueError(
            f"FaultToleranceKwargs(semi_sync={handler.semi_sync!r}) with mixed_precision='fp16' is not "
            "supported: a step the GradScaler skips in one group (inf/NaN in its own gradients) would put the "
            "groups' sync schedules apart; use bf16, or semi_sync=None (the skip is then decided on the "
            "gradients averaged across groups, the same on every group)"
        )
    if fsdp_plugin is not None or parallelism_config is not None:  # FSDP2/HSDP in each group: fault_tolerance_fsdp.py
        c, what = parallelism_config, "fsdp_plugin" if fsdp_plugin is not None else "parallelism_config"
        sizes = ("tp_size", "cp_size", "sp_size", "pp_size", "ep_size")
        others = ", ".join(f"{k}={getattr(c, k)}" for k in sizes if c is not None and getattr(c, k) > 1)
        ignored = getattr(fsdp_plugin, "ignored_modules", None)
        for refused, why in (
            (handler.semi_sync is not None, f"semi_sync={handler.semi_sync!r}: LocalSGD/DiLoCo sync whole models; "
             "use semi_sync=None (the gradient shards are averaged across groups every step)"),
            (others, f"ParallelismConfig({others}): only dp_shard_size (FSDP2) and dp_replicate_size (HSDP) run "
             "inside a replica group; set the others to 1"),
            (c is not None and c.dp_shard_size == 1, f"ParallelismConfig(dp_shard_size=1, dp_replicate_size="
             f"{getattr(c, 'dp_replicate_size', 1)}): that only replicates, as DDP in each group does; drop it"),
            (ignored is not None, f"FullyShardedDataParallelPlugin(ignored_modules={ignored!r}): FSDP reduces no "
             "gradients of ignored modules, so no group would average them; set ignored_modules=None"),
            (not state.use_distributed or state.num_processes == 1, "a replica group of 1 process: FSDP shards "
             "over the group's processes; run --num_processes >= 2 per group, or drop it (DDP in each group)"),
        ):  # fmt: skip
            if refused:
                raise ValueError(f"FaultToleranceKwargs with Accelerator({what}=...) is not supported with {why}")
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
        ft.precision = precision
        self.plan = dataclasses.replace(self.plan, ddp=DDPPlan(self.handler, self.plan.ddp.device_ids))
        self._optimizers = 0
        self._trained: torch.nn.Module | None = None  # the model LocalSGD/DiLoCo sync (semi_sync)

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(unwrap_compiled(module), DistributedDataParallel):
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module
        if self.ft.handler.semi_sync is None:
            return wrap_model(module, self.ft, self.plan.ddp)
        if self._trained is not None:
            raise ValueError(
                f"FaultToleranceKwargs(semi_sync={self.ft.handler.semi_sync!r}) syncs one model across replica "
                "groups: prepare one trainable model"
            )
        self._trained = module  # plain DDP inside the group; torchft's LocalSGD/DiLoCo across the groups
        return apply_ddp(module, self.plan.ddp) if self.ft.group_size > 1 else module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizers = one_optimizer(self._optimizers)
        optimizer = super().setup_optimizer(optimizer)
        handler = self.ft.handler
        if handler.semi_sync is None:
            return CommitGate(self.ft, optimizer, scaled=self.precision.scaler is not None)
        if self._trained is None:
            raise ValueError(
                f"FaultToleranceKwargs(semi_sync={handler.semi_sync!r}): prepare the model before its optimizer"
            )
        self.ft.semi = semi_sync(self.ft, self._trained, optimizer)
        return optimizer


def one_optimizer(prepared: int) -> int:
    """The number of optimizers prepared once this one is: one at most (each step commits once)."""
    if prepared:
        raise ValueError(
            "FaultToleranceKwargs trains one optimizer: each step commits once across replica groups "
            "(torchft's should_commit); put every parameter group into one optimizer"
        )
    return prepared + 1


def semi_sync(ft: FaultTolerance, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torchft's ``LocalSGD`` or ``DiLoCo`` on ``model`` (the module inside the group's DDP), entered
    for good: its hooks on ``optimizer`` count the steps and sync every ``sync_every``."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    handler = ft.handler
    if handler.semi_sync == "local_sgd":
        return LocalSGD(ft.manager, model, optimizer, handler.sync_every).__enter__()
    if handler.should_quantize:  # checked at construction too; here the model's device and torchft's own flag
        import torchft.manager

        devices = sorted({p.device.type for p in model.parameters()} - {"cuda"})
        if devices or not torchft.manager.IS_TRITON_AVAILABLE:
            why = f"the model is on {', '.join(devices)}" if devices else "torchft found no triton"
            raise ValueError(
                f"FaultToleranceKwargs.should_quantize=True needs the model on a CUDA GPU and triton, but {why}: "
                "torchft would send the pseudo-gradients unquantized; drop should_quantize"
            )
    fragments = split_fragments(model, handler.fragments)
    outer = [
        torch.optim.SGD(
            f.parameters(), lr=handler.outer_lr, momentum=handler.outer_momentum, nesterov=handler.outer_nesterov
        )
        for f in fragments
    ]
    return DiLoCo(
        ft.manager, fragments, optimizer, outer, handler.sync_every,
        should_quantize=handler.should_quantize, fragment_sync_delay=handler.fragment_sync_delay,
    ).__enter__()  # fmt: skip


class _Fragment(torch.nn.Module):
    """Some of a model's parameters (the same tensors), as torchft's DiLoCo takes a fragment."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def split_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """The trainable parameters in ``n`` contiguous fragments (in ``named_parameters`` order, the
    same in every group) of about equal numbers of elements, none empty."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    if n > len(named):
        raise ValueError(
            f"FaultToleranceKwargs.fragments={n} is more than the model's {len(named)} trainable parameter tensors"
        )
    total = sum(p.numel() for _, p in named)
    pieces: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    done = 0
    for i, (k, p) in enumerate(named):
        pieces[-1].append((k, p))
        done += p.numel()
        params_left, pieces_left = len(named) - i - 1, n - len(pieces)
        if pieces_left and (done >= total * len(pieces) / n or params_left == pieces_left):
            pieces.append([])
    return [_Fragment(piece) for piece in pieces]


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
    """torchft's ``OptimizerWrapper`` semantics: the quorum at ``zero_grad``, the commit at ``step``.

    With fp16 (``scaled``) it handles the loss scale itself (``_step_supports_amp_scaling``), so
    that the GradScaler calls ``step`` even for gradients with inf/NaN: the step is committed on
    every group (a step of the job, counted) and the update skipped on every group alike, since
    the gradients it looks at are those averaged across the groups."""

    def __init__(self, ft: FaultTolerance, optimizer: torch.optim.Optimizer, scaled: bool = False) -> None:
        # Deliberately no super().__init__: every attribute is the wrapped optimizer's.
        self.ft = ft
        self.optimizer = optimizer
        if scaled:
            self._step_supports_amp_scaling = True

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
        # set by the GradScaler before it calls step (fp16), deleted after
        found_inf, grad_scale = self.__dict__.get("found_inf"), self.__dict__.get("grad_scale")
        if not self.ft.commit():
            return None
        if found_inf is None:
            return self.optimizer.step()
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):  # it unscales and skips by itself
            self.optimizer.grad_scale, self.optimizer.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
            try:
                return self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf  # type: ignore[attr-defined]
        if found_inf.item():  # the averaged gradients hold inf/NaN: skipped here as on every group
            return None
        if grad_scale is not None:  # not unscaled yet (no clip_grad_norm_ before the step)
            inv = grad_scale.double().reciprocal().float()
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return self.optimizer.step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "ft", "found_inf", "grad_scale"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"CommitGate({self.optimizer!r})"
