"""FSDP2: sharded data parallelism with torch's ``fully_shard``, the only place it is called
(``apply_fsdp``, the parallelize pipeline's wrapping step for this strategy).

Consumes ``FullyShardedDataParallelPlugin``, once, at construction (``fsdp_plan``): what the
parallelize pipeline does to each model (``parallelize.py``), in one step and bottom-up:
tensor parallelism (with a ``ParallelismConfig`` whose ``tp_size > 1``), activation
checkpointing on the blocks the wrap policy picks, compilation of each block, ``fully_shard`` on
each block, then on the root, all on the meta device: only each process's shards are then
allocated and filled (``materialise``: from each process's own copy, from the main process, or
initialised; a model built on meta works too). Parameters become DTensors holding 1/N of each
tensor; the optimizer built before ``prepare`` is rebound to them, and nothing keeps a
full-size tensor. Mixed precision is FSDP's ``MixedPrecisionPolicy``, which the precision gives
(parameters gathered in low precision, gradients reduced in fp32, fp32 master shards; fp16's
scaler is then a ``ShardedGradScaler``), so the precision's autocast forward is not added. State
dicts go through ``torch.distributed.checkpoint.state_dict`` (full ones with the model's own
keys, gathered to the main process on the CPU or where the plugin's full ``state_dict_config`` /
``optim_state_dict_config`` says; sharded ones for ``torch.distributed.checkpoint``).

The mesh is 1-D over every process (a CPU mesh on gloo), or with a ``ParallelismConfig`` the
data dims of the run's N-D mesh: 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP, else
``dp_shard_cp``; tensor parallelism then splits the planned layers on the ``tp`` dim first, so
FSDP shards DTensors that already hold 1/tp of each of them.

With one process there is no process group to shard over: the module is placed (a meta
model allocated and initialised) and given the autocast forward as on one device, and checkpoints still use the
sharded ("dcp") layout,
so they load at any number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hasten.distributed.state import DistributedType
from hasten.settings.groups import init_mesh
from hasten.strategies.base import Strategy, by_names, has_dtensor, unwrap_compiled
from hasten.strategies.parallelize import (
    BlockPolicy,
    CheckpointingPlan,
    MaterialisePlan,
    ModelParts,
    ParallelizePlan,
    ShardingPlan,
    TensorParallelPlan,
    ignored_params,
    parallelize,
)

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.settings.parallelism import ParallelismConfig
    from hasten.settings.plugins import FullyShardedDataParallelPlugin
    from hasten.strategies.expert_parallel import ExpertParallelPlan
    from hasten.training.compile import Compiler
    from hasten.training.precision import Precision

#: FSDP2 averages gradients wrongly (a sum) on gloo before this release (pytorch#162338,
#: fixed on main on 2025-12-29 by pytorch#171458, after the 2.10 branch cut)
MIN_TORCH = (2, 11)


def check_torch_version(version: str = torch.__version__) -> None:
    """Refuse FSDP on a torch that averages FSDP2 gradients wrongly on gloo."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    found = (int(parts.group(1)), int(parts.group(2))) if parts else (0, 0)
    if found < MIN_TORCH:
        raise RuntimeError(
            f"FSDP in hasten needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {version}: older FSDP2 sums "
            "the gradients instead of averaging them on the gloo backend (pytorch/pytorch#162338). "
            "Upgrade torch, or train without fsdp_plugin (DDP)"
        )


def _is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp_plan(
    state: ProcessState,
    precision: Precision,
    plugin: FullyShardedDataParallelPlugin,
    compiler: Compiler | None = None,
    tp_mesh: Any = None,
    tp_given: dict[str, str] | None = None,
) -> ParallelizePlan:
    """What the pipeline does to each model with this plugin, decided once: FSDP's units,
    tensor parallelism on ``tp_mesh``, activation checkpointing, compilation, ``fully_shard``'s
    arguments (over several processes) and how a meta model gets its numbers."""
    device = state.device
    pin_memory = device.type != "cpu"  # pinned host memory needs an accelerator
    sharding = None
    if state.use_distributed:
        given = plugin.given_mixed_precision()
        ignored = plugin.ignored_modules
        sharding = ShardingPlan(
            mp_policy=precision.fsdp_mixed_precision(given),
            root_mp_policy=precision.fsdp_mixed_precision(given, root=True),
            offload_policy=plugin.offload_policy(pin_memory),
            reshard_after_forward=plugin.reshard_after_forward,
            ignored_modules=ignored if ignored is None or isinstance(ignored, str) else tuple(ignored),
        )
    return ParallelizePlan(
        device=device,
        precision=precision,
        blocks=BlockPolicy(
            plugin.auto_wrap_policy, tuple(plugin.transformer_cls_names_to_wrap or ()), plugin.min_num_params
        ),
        tp=TensorParallelPlan(tp_mesh, tp_given) if tp_mesh is not None and sharding is not None else None,
        activation_checkpointing=CheckpointingPlan.from_plugin(plugin, pin_memory, compiler),
        compile=compiler,
        sharding=sharding,
        materialise=MaterialisePlan(
            num_processes=state.num_processes,
            is_main_process=state.is_main_process,
            device=device,
            param_device=torch.device("cpu") if plugin.cpu_offload is not False else device,
            init_fn=plugin.param_init_fn,
        ),
    )


def apply_fsdp(parts: ModelParts, plan: ShardingPlan, mesh: Any, ep: ExpertParallelPlan | None = None) -> None:
    """``fully_shard`` on each block, then on the root, in place (on the meta device where the
    pipeline moved the parameters there); with expert parallelism, each experts module first, on
    ``efsdp`` (or ``(dp_replicate, efsdp)``), its matrices sharded along dim 1; where that mesh is
    one process, the experts are left out of FSDP (``expert_parallel.needs_fsdp``)."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(parts.ignored)
    kwargs = dict(mesh=mesh, reshard_after_forward=plan.reshard_after_forward, offload_policy=plan.offload_policy)
    if ep is not None:  # each experts module on efsdp, along dim 1 (dim 0 is already split over ep)
        from torch.distributed.tensor import Shard

        from hasten.strategies import expert_parallel

        sharded = expert_parallel.needs_fsdp(ep, plan.offload_policy)
        for experts in parts.experts:
            if not sharded:  # nothing to shard or reduce on a one-process efsdp: FSDP would only copy
                ignored.update(expert_parallel.leave_unsharded(experts, plan.mp_policy))
                continue
            expert_kwargs = dict(kwargs, mesh=ep.efsdp_mesh, shard_placement_fn=lambda p: Shard(1))
            fully_shard(experts, mp_policy=plan.mp_policy, ignored_params=set(parts.ignored) or None, **expert_kwargs)
    kwargs["ignored_params"] = ignored or None
    for block in parts.blocks:
        fully_shard(block, mp_policy=plan.mp_policy, **kwargs)
    if kwargs["reshard_after_forward"] is True:
        # torch's own choice for the root: its parameters are gathered again right away for the
        # backward, so resharding them after forward would only add one all-gather per step
        kwargs["reshard_after_forward"] = None
    fully_shard(parts.inner, mp_policy=plan.root_mp_policy, **kwargs)


class FSDP2Strategy(Strategy):
    """Several processes, each holding 1/N of every parameter, gradient and optimizer state."""

    name = "fsdp"
    distributed_type = DistributedType.FSDP

    def __init__(
        self,
        state: ProcessState,
        precision: Precision,
        plugin: FullyShardedDataParallelPlugin,
        compiler: Compiler | None = None,
        parallelism: ParallelismConfig | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__(state, precision, compiler)
        check_torch_version()
        self.sharded = state.use_distributed
        if self.sharded and precision.scaler is not None and not precision.sharded:
            raise ValueError(
                "FSDP shards over several processes with fp16, so its gradient scaler must be a ShardedGradScaler: "
                "build the Precision with sharded=True (the Accelerator does)"
            )
        self.plugin = plugin
        #: N-D parallelism: the run's mesh (hasten.settings.parallelism), None for a 1-D mesh over every process
        self.parallelism = parallelism
        self.device_mesh = device_mesh
        #: the mesh dim that tensor parallelism splits layers over (None: no TP)
        self.tp_mesh = device_mesh["tp"] if device_mesh is not None and parallelism.tp_enabled else None
        self.plan = fsdp_plan(
            state, precision, plugin, compiler, self.tp_mesh, parallelism.tp_plan if parallelism else None
        )
        if self.sharded and parallelism is not None and parallelism.ep_size > 1:
            from hasten.strategies.expert_parallel import expert_parallel_plan

            self.plan = dataclasses.replace(self.plan, ep=expert_parallel_plan(parallelism))
        self.checkpoint_layout = "dcp" if plugin.state_dict_type == "SHARDED_STATE_DICT" else "full"
        #: where full state dicts are gathered, (offload_to_cpu, rank0_only): the plugin's full configs
        self.full_model_gather = plugin.full_gather("state_dict_config")
        self.full_optim_gather = plugin.full_gather("optim_state_dict_config")
        self._mesh: Any = None

    # ------------------------------------------------------------------ modules
    @property
    def mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: 1-D over every process, or the data dims of the
        N-D mesh (2-D ``(dp_replicate, dp_shard_cp)`` for HSDP)."""
        if self._mesh is None:
            if self.device_mesh is not None:
                names = self.parallelism.fsdp_dim_names
                flat = self.parallelism.flattened.get("dp_shard_cp")
                self._mesh = self.device_mesh[tuple(names)] if len(names) > 1 or flat is None else flat
            else:
                self._mesh = init_mesh(self.state.device.type, (self.state.num_processes,))
        return self._mesh

    def setup_module(
        self, module: torch.nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        inner = unwrap_compiled(module)
        if isinstance(inner, DistributedDataParallel):
            raise ValueError(
                "prepare() got a model already wrapped in DistributedDataParallel, but this Accelerator shards "
                "with FSDP (fsdp_plugin): pass the plain module (model.module), hasten wraps it"
            )
        if _is_fsdp(inner):
            return module  # prepared (or sharded by the user) before
        plan = self.plan.for_call(device_placement, evaluation_mode)
        module = parallelize(module, inner, plan, self.wrap_model, self.swaps)
        if not evaluation_mode:
            self._modules.append(inner)
        return module

    def wrap_model(self, model: torch.nn.Module, parts: ModelParts) -> torch.nn.Module:
        """Sharded in place (``apply_fsdp``) where there are several processes; else as it is."""
        if self.plan.sharding is not None:
            # on the mesh's device, whatever device_placement says
            apply_fsdp(parts, self.plan.sharding, self.mesh, self.plan.ep)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point the optimizer at the sharded DTensor parameters, groups and hyperparameters kept;
        with float8 all-gather, the scales of the next all-gather are computed after each step; with
        tensor parallelism, the first step checks the gradients of parameters kept whole over tp."""
        if not self.sharded:
            self.swaps.rebind(optimizer)  # float8 layers' weights, where fp8 converted them
            return optimizer
        from torch.distributed.tensor import DTensor

        if optimizer.state and any(p in self.swaps for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "prepare() got an optimizer that has already stepped on the unsharded parameters; with FSDP build "
                "it before any step (its state is created on the shards) or load its state after prepare"
            )
        self.swaps.rebind(optimizer)
        if any(not isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
            _rebind_resharded(optimizer, self._modules)  # built after a forward without backward (eval first)
        stray = sum(not isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
        ignored = {id(p) for m in self._modules for p in ignored_params(m, self.plan.sharding)}
        stray -= sum(id(p) in ignored for g in optimizer.param_groups for p in g["params"])
        if stray:
            raise ValueError(
                f"prepare() got an optimizer with {stray} parameter(s) that belong to no model sharded by this "
                "Accelerator: prepare the model before the optimizer, or both in one prepare(model, optimizer) call"
            )
        if self.plan.float8 is not None and self.plan.float8.all_gather:
            from hasten.training.float8 import precompute_scales

            model = self.model_of(optimizer)
            if model is not None:
                optimizer.register_step_post_hook(precompute_scales(model))
        if self.plan.tp is not None:  # parameters kept whole over tp: whole gradients, checked at the first step
            from hasten.strategies.tensor_parallel import replicated_grad_check

            model = self.model_of(optimizer)
            if model is not None:
                replicated_grad_check(model, self.plan.tp.mesh).install(optimizer)
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return _no_gradient_sync(inner) if _is_fsdp(inner) else contextlib.nullcontext()

    def trigger_sync_in_backward(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return _gradient_sync_on(inner) if _is_fsdp(inner) else contextlib.nullcontext()

    # ------------------------------------------------------------------ state dicts
    def model_state_dict(
        self, module: torch.nn.Module, full: bool = True, *, check_filled: bool = True
    ) -> dict[str, Any]:
        """Full: gathered where the plugin's ``state_dict_config`` says (by default to the main
        process on the CPU, empty elsewhere). Not full: this process's shards as DTensors, with the
        global shapes (what ``torch.distributed.checkpoint`` saves).
        A model built on the meta device with tensors nothing has filled is refused (``check_filled``)."""
        inner = self.unwrap(module)
        if check_filled:
            from hasten.strategies.materialise import require_filled

            require_filled(inner, "saving the model")
        if not _is_fsdp(inner):
            return self.plain(inner.state_dict())
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        gather = self.full_model_gather if full else None
        return self.plain(_gathered(lambda options: get_model_state_dict(inner, options=options), gather))

    def load_model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Every process passes the full state dict (each keeps its shards), or a sharded one."""
        from hasten.strategies.materialise import mark_filled

        inner = self.unwrap(module)
        if not _is_fsdp(inner):
            result = inner.load_state_dict(state_dict, strict=strict)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = not has_dtensor(state_dict)
            result = set_model_state_dict(
                inner, state_dict, options=StateDictOptions(full_state_dict=full, strict=strict)
            )
        mark_filled(inner, state_dict.keys())
        self.refresh_float8(inner)
        return result

    def refresh_float8(self, module: torch.nn.Module) -> None:
        """With float8 all-gather, the scales of the next all-gather computed again from weights
        just loaded (they are computed after each optimizer step; a collective)."""
        if self.plan.float8 is not None and self.plan.float8.all_gather and self.plan.sharding is not None:
            from hasten.training.float8 import precompute_scales

            precompute_scales(module)()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, full: bool = True) -> dict[str, Any]:
        """Keyed by parameter names; full: gathered where the plugin's ``optim_state_dict_config``
        says (by default to the main process on the CPU, empty elsewhere)."""
        model = self.model_of(optimizer)
        if model is None:
            return self.plain(optimizer.state_dict())
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        gather = self.full_optim_gather if full else None
        return self.plain(_gathered(lambda options: get_optimizer_state_dict(model, inner, options=options), gather))

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """``state_dict`` keyed by parameter names (full, or this process's shards) or by index
        (torch's own, a one-process or DDP checkpoint's)."""
        model = self.model_of(optimizer)
        if model is None:
            super().load_optimizer_state_dict(optimizer, state_dict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state_dict = by_names(state_dict, self.optimizer_names(optimizer))
        set_optimizer_state_dict(
            model,
            getattr(optimizer, "optimizer", optimizer),
            state_dict,
            # full: each process keeps its part of the full state; a plain (one-process) model takes it as is
            options=StateDictOptions(full_state_dict=_is_fsdp(model) and not has_dtensor(state_dict.get("state", {}))),
        )

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every shard; the same (plain) tensor on every process."""
        if self.tp_mesh is not None or self.plan.ep is not None:  # DTensors on several sub-meshes
            from hasten.strategies.tensor_parallel import clip_grad_norm_

            return clip_grad_norm_(parameters, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def __repr__(self) -> str:
        facts = f"device={self.state.device}, num_processes={self.state.num_processes}"
        return f"{type(self).__name__}({facts}, sharded={self.sharded})"


def _rebind_resharded(optimizer: torch.optim.Optimizer, modules: list[torch.nn.Module]) -> None:
    """Point ``optimizer`` at the shards where it holds the unsharded parameters of a sharded model.

    FSDP2 leaves the root (or a module with ``reshard_after_forward=False``) unsharded after a
    forward without backward: an evaluation before training (the Hugging Face Trainer's
    ``evaluate()`` before ``train()``) leaves ``model.parameters()`` unsharded, and an optimizer
    built then holds them. Those modules are resharded (``FSDPModule.reshard``: what the next
    forward would all-gather again, nothing else changes) and the optimizer's groups take each
    parameter's shard, groups and hyperparameters kept."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    found: dict[int, torch.Tensor] = {}
    for model in modules:
        before = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if id(p) in mine]
        if not before:
            continue
        for m in model.modules():
            if _is_fsdp(m):
                m.reshard()
        found.update({id(p): m._parameters[n] for m, n, p in before if m._parameters[n] is not p})
    if not found:
        return
    if any(id(p) in found for p in optimizer.state):
        raise ValueError(
            "prepare() got an optimizer that has already stepped on the unsharded parameters of a sharded model; "
            "build it before any step (its state is created on the shards) or load its state after prepare"
        )
    for group in optimizer.param_groups:
        group["params"] = [found.get(id(p), p) for p in group["params"]]


def _gathered(get: Any, gather: tuple[bool, bool] | None) -> dict[str, Any]:
    """``get(StateDictOptions)``'s state dict: this process's shards (``gather`` None), or full,
    gathered as ``gather = (offload_to_cpu, rank0_only)`` says. ``StateDictOptions`` has one flag
    for both (``cpu_offload``: on the main process's CPU; without it, on every process's device);
    the two other combinations gather the shards with torch's own function for that, one tensor
    at a time (so offloading never holds the whole state dict on the device)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if gather is None:
        return get(StateDictOptions(full_state_dict=False))
    offload_to_cpu, rank0_only = gather
    if offload_to_cpu == rank0_only:
        return get(StateDictOptions(full_state_dict=True, cpu_offload=offload_to_cpu))
    from torch.distributed._state_dict_utils import _gather_state_dict

    sharded = get(StateDictOptions(full_state_dict=False))
    return _gather_state_dict(sharded, cpu_offload=offload_to_cpu, ranks_only=(0,) if rank0_only else ())


@contextlib.contextmanager
def _no_gradient_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    module._hasten_no_sync = True
    try:
        yield
    finally:
        module._hasten_no_sync = False
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _gradient_sync_on(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(True)
    try:
        yield
    finally:
        if getattr(module, "_hasten_no_sync", False):  # back to no_sync's setting
            module.set_requires_gradient_sync(False)
