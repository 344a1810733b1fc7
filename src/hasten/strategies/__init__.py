"""Wrapping strategies: how a prepared model is placed, wrapped and checkpointed.

A strategy is chosen once, in ``Accelerator.__init__`` (``choose_strategy`` below is the only
place that chooses), and decides there, once, what ``prepare`` does to every model: its
``plan`` (``parallelize.ParallelizePlan``, a frozen description). ``setup_module`` runs the
parallelize pipeline (``parallelize.parallelize``) with that plan: in torchtitan's order, tensor
parallelism, activation checkpointing, compilation of each block, the strategy's own wrapper
(FSDP's ``fully_shard`` in ``fsdp.py``, DDP in ``ddp.py``), then materialising and
initialising a sharded model. The interface (:class:`~hasten.strategies.base.Strategy`) follows
Lightning Fabric's strategies:

``setup_module``            the parallelize pipeline: place the module, add the precision's
                            autocast forward (FSDP: its MixedPrecisionPolicy instead), wrap or shard it
``setup_optimizer``         rebind an optimizer to the parameters the wrapper owns
``no_sync``                 skip gradient synchronisation inside a block
``unwrap``                  the user's own module (without DDP, FSDP or ``torch.compile``)
``model_state_dict`` ...    full state dicts with the model's own keys, and their loading
``clip_grad_norm_``         clipping over all of a model's gradients (global norm when sharded)
``checkpoint_layout``       the checkpoint layout (hasten.checkpoint.layouts) its state is saved in

The strategies: ``single.py`` (one process), ``ddp.py`` (DistributedDataParallel) and
``fsdp.py`` (FSDP2: ``fully_shard`` per block then the root on a 1-D DeviceMesh, chosen whenever
a ``FullyShardedDataParallelPlugin`` is given, also on one process; its checkpoints use the
sharded "dcp" layout; with a ``ParallelismConfig`` that shards or splits layers, on the data dims
of the N-D mesh, after ``tensor_parallel.py``'s plan on the ``tp`` dim). A strategy may also set
``distributed_type`` (what the Accelerator reports). Where FSDP shards over several processes
the precision is built with ``sharded=True`` (``shards_gradients`` below says so, before the
strategy exists), so fp16's scaler is FSDP's ``ShardedGradScaler`` from the start.

Adding a strategy: a module here with a ``Strategy`` subclass, and one branch in
``choose_strategy``. Adding a parallelism or a precision: one ``apply_*`` step in
``parallelize.py`` and one field of its plan. Nothing else changes: the Accelerator,
checkpoints and profiling only call the interface.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from hasten.strategies.base import Strategy, is_compiled, own_keys, strip_wrappers, unwrap_compiled

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.settings.handlers import DistributedDataParallelKwargs
    from hasten.settings.parallelism import ParallelismConfig
    from hasten.settings.plugins import FullyShardedDataParallelPlugin, TorchDynamoPlugin
    from hasten.training.precision import Precision

__all__ = [
    "Strategy",
    "choose_strategy",
    "is_compiled",
    "own_keys",
    "shards_gradients",
    "unwrap_any",
    "unwrap_compiled",
    "uses_fsdp",
]


def uses_fsdp(
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    parallelism: ParallelismConfig | None = None,
    device_mesh: Any = None,
) -> bool:
    """FSDP2 is the strategy: a plugin is given (on any number of processes), or an N-D mesh
    shards or splits layers (HSDP, FSDP, TP x FSDP), or replicates pipeline stages (FSDP2 on
    ``(dp_replicate, dp_shard_cp)`` with shards of one: torch's stages reduce FSDP's gradients
    after the last microbatch, and DDP's reducer fails on several backwards per step)."""
    if fsdp_plugin is not None:
        return True
    if device_mesh is None:
        return False
    return not parallelism.replicate_only or (parallelism.pp_enabled and parallelism.dp_replicate_enabled)


def shards_gradients(
    state: ProcessState,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    parallelism: ParallelismConfig | None = None,
    device_mesh: Any = None,
) -> bool:
    """FSDP shards over several processes: what ``Precision(sharded=...)`` needs to know."""
    return state.use_distributed and uses_fsdp(fsdp_plugin, parallelism, device_mesh)


def choose_strategy(
    state: ProcessState,
    precision: Precision,
    ddp_handler: DistributedDataParallelKwargs | None = None,
    dynamo_plugin: TorchDynamoPlugin | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    parallelism: ParallelismConfig | None = None,
    device_mesh: Any = None,
    fp8: tuple[str, Any] | None = None,
    fault_tolerance: Any = None,
) -> Strategy:
    """The strategy for this process: FSDP2 (``uses_fsdp``: a plugin, or an N-D mesh that shards
    or splits layers, on ``device_mesh``), else DDP when several processes train (a mesh with only
    ``dp_replicate`` too), else one device; with ``torch.compile`` when the dynamo plugin enables it,
    and fp8's conversion first in its plan where ``fp8`` (backend, recipe handler) is given. With
    ``fault_tolerance`` (``strategies/fault_tolerance.py``'s, torchft's manager): DDP (or FSDP2/HSDP, as
    ``uses_fsdp`` says) inside each replica group, torchft's manager across them."""
    if fault_tolerance is not None:
        strategy = _fault_tolerant(
            state, precision, ddp_handler, dynamo_plugin, fault_tolerance, fsdp_plugin, parallelism, device_mesh
        )
    else:
        strategy = _choose(state, precision, ddp_handler, dynamo_plugin, fsdp_plugin, parallelism, device_mesh)
    if parallelism is not None and device_mesh is not None and parallelism.pp_enabled:
        strategy = _pipelined(strategy, precision, parallelism, device_mesh)
    if parallelism is not None and device_mesh is not None and parallelism.sp_enabled:
        from hasten.strategies.sequence_parallel import SequenceParallelPlan

        sp = SequenceParallelPlan(device_mesh["sp"], parallelism.tp_size)
        strategy.plan = dataclasses.replace(strategy.plan, sp=sp)
    if fp8 is not None:
        from hasten.training.float8 import plan_float8

        sharded = strategy.plan.sharding is not None
        plan = plan_float8(fp8[1], fp8[0], state.device, sharded=sharded, process_group_backend=state.backend)
        strategy.plan = dataclasses.replace(strategy.plan, float8=plan)
    return strategy


def _choose(
    state: ProcessState,
    precision: Precision,
    ddp_handler: DistributedDataParallelKwargs | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    parallelism: ParallelismConfig | None,
    device_mesh: Any,
) -> Strategy:
    compiler = None
    if dynamo_plugin is not None and dynamo_plugin.enabled:
        from hasten.training.compile import Compiler

        compiler = Compiler(dynamo_plugin)
    if uses_fsdp(fsdp_plugin, parallelism, device_mesh):
        from hasten.settings.plugins import FullyShardedDataParallelPlugin as Plugin
        from hasten.strategies.fsdp import FSDP2Strategy

        if device_mesh is None:
            if state.use_distributed:
                fsdp_plugin.check_num_processes(state.num_processes)  # hasten launch checks the same first
            return FSDP2Strategy(state, precision, fsdp_plugin, compiler)
        plugin = fsdp_plugin if fsdp_plugin is not None else Plugin()
        plugin.check_num_processes(parallelism.dp_shard_size * parallelism.cp_size * parallelism.sp_size)  # they shard
        return FSDP2Strategy(state, precision, plugin, compiler, parallelism, device_mesh)
    if device_mesh is not None and parallelism.pp_enabled:  # pipeline stages, not replicated
        from hasten.strategies.single import SingleDeviceStrategy

        return SingleDeviceStrategy(state, precision, compiler)
    if state.use_distributed:
        from hasten.strategies.ddp import DDPStrategy

        return DDPStrategy(state, precision, ddp_handler, compiler)
    from hasten.strategies.single import SingleDeviceStrategy

    return SingleDeviceStrategy(state, precision, compiler)


def _fault_tolerant(
    state: ProcessState,
    precision: Precision,
    ddp_handler: DistributedDataParallelKwargs | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    fault_tolerance: Any,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    parallelism: ParallelismConfig | None = None,
    device_mesh: Any = None,
) -> Strategy:
    """DDP in each replica group, or FSDP2 (HSDP with a ParallelismConfig) over the group's processes
    (``fault_tolerance_fsdp.py``); torchft's manager across them (``fault_tolerance.start`` refused
    what neither supports already, before reaching the lighthouse)."""
    compiler = None
    if dynamo_plugin is not None and dynamo_plugin.enabled:
        from hasten.training.compile import Compiler

        compiler = Compiler(dynamo_plugin)
    if uses_fsdp(fsdp_plugin, parallelism, device_mesh):
        from hasten.settings.plugins import FullyShardedDataParallelPlugin as Plugin
        from hasten.strategies.fault_tolerance_fsdp import FaultTolerantFSDPStrategy

        plugin = fsdp_plugin if fsdp_plugin is not None else Plugin()
        plugin.check_num_processes(state.num_processes if device_mesh is None else parallelism.dp_shard_size)
        return FaultTolerantFSDPStrategy(
            state, precision, plugin, fault_tolerance, compiler, parallelism if device_mesh is not None else None,
            device_mesh,
        )  # fmt: skip
    from hasten.strategies.fault_tolerance import FaultTolerantDDPStrategy

    return FaultTolerantDDPStrategy(state, precision, fault_tolerance, ddp_handler, compiler)


def _pipelined(strategy: Strategy, precision: Precision, parallelism: ParallelismConfig, mesh: Any) -> Strategy:
    """``strategy`` (the data dims') inside pipeline parallelism on the mesh's ``pp`` dim."""
    from hasten.strategies.pipeline_parallel.schedule import PipelinePlan
    from hasten.strategies.pipeline_parallel.strategy import PipelineStrategy

    if precision.scaler is not None:
        raise ValueError(
            "ParallelismConfig(pp_size>1) with mixed_precision='fp16' is not supported: fp16's gradient scaler "
            "would skip steps on some pipeline stages and not on others; use mixed_precision='bf16' (or 'no')"
        )
    return PipelineStrategy(strategy, PipelinePlan.build(parallelism.pp_handler, mesh["pp"], strategy.state.device))


def unwrap_any(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without any wrapper a strategy or ``torch.compile`` puts around it (for code
    that has a module but no Accelerator, such as ``hasten.checkpoint.load_model``)."""
    from hasten.strategies.ddp import ddp_inner

    return strip_wrappers(module, ddp_inner)
