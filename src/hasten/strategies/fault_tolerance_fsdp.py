"""FSDP2 (or HSDP) inside each replica group, torchft's manager across the groups.

``Accelerator(kwargs_handlers=[FaultToleranceKwargs(...)], fsdp_plugin=...)`` (or a
``ParallelismConfig`` that only shards, ``dp_shard_size > 1`` with or without ``dp_replicate_size``):
the model is ``fully_shard``'ed by hasten's FSDP strategy (``fsdp.py``) over the group's own
processes, and the replicate dim runs across the groups through torchft, as torchtitan wires it
(``experiments/torchft``) and torchft's own FSDP test does:

* gradients: each FSDP unit's reduce-scatter output (this process's shard of the gradients,
  averaged inside the group; with HSDP after its all-reduce) goes through ``Manager.allreduce``
  in FSDP's ``set_all_reduce_hook``, during backward, as DDP's buckets do in
  :mod:`~hasten.strategies.fault_tolerance`. Rank r of every group holds the same shard, and
  torchft's process group joins rank r of every group, so each shard is averaged over the groups
  (a healing group sends zeros and receives the average). Clipping and fp16's inf check then see
  the gradients averaged across groups, the same on every group.
* the optimizer: the same :class:`~hasten.strategies.fault_tolerance.CommitGate` (the quorum at
  ``zero_grad``, the step only when ``Manager.should_commit()`` says it is committed). fp16: FSDP's
  ``ShardedGradScaler`` unscales and checks for inf/NaN over the group itself; since the gradients
  are the same in every group, a skipped update is skipped on every group (and not committed there).
* healing, shard by shard: every rank of the group registers what a rejoining group receives,
  and torchft's transport (HTTP, one server per rank) sends rank r's to rank r. torchft reads it
  on its quorum thread, while this group may be in the middle of a forward (where FSDP2 has
  swapped the unsharded parameters in): so it is never ``module.state_dict()`` there, but the
  sharded parameters and buffers found once on the main thread at ``prepare``, each DTensor sent
  as its local shard with its placements and global shape. The receiving group (on the main thread,
  in ``should_commit``) copies each shard into its own, and rebuilds the optimizer's state as
  DTensors on its own mesh. The rest (schedulers, registered objects, the GradScaler, ...) goes
  through FaultTolerance's own functions, as with DDP. A skipped fp16 update is not a committed
  step here (with DDP it is): ``accelerator.step`` does not count it.

Refused, by name, before the lighthouse is reached (``fault_tolerance.start``): ``semi_sync``,
tensor/context/sequence/pipeline/expert parallelism, a ``ParallelismConfig`` that only replicates,
``ignored_modules``, and a group of one process (nothing to shard over).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hasten.strategies.base import unwrap_compiled
from hasten.strategies.fault_tolerance import CommitGate, one_optimizer
from hasten.strategies.fsdp import FSDP2Strategy, _is_fsdp

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.settings.parallelism import ParallelismConfig
    from hasten.settings.plugins import FullyShardedDataParallelPlugin
    from hasten.strategies.fault_tolerance import FaultTolerance
    from hasten.strategies.parallelize import ModelParts
    from hasten.training.compile import Compiler
    from hasten.training.precision import Precision

#: what marks a DTensor sent as its local shard (a dict, so torchft's transport moves the tensor to the CPU)
_SHARD = "__hasten_shard__"


class FaultTolerantFSDPStrategy(FSDP2Strategy):
    """FSDP2 over the group's processes, each gradient shard averaged across the groups by
    torchft's manager (FSDP's all-reduce hook), the commit gate on the optimizer."""

    def __init__(
        self,
        state: ProcessState,
        precision: Precision,
        plugin: FullyShardedDataParallelPlugin,
        ft: FaultTolerance,
        compiler: Compiler | None = None,
        parallelism: ParallelismConfig | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__(state, precision, plugin, compiler, parallelism, device_mesh)
        self.ft = ft
        ft.precision = precision
        self._optimizers = 0
        self._shards: dict[int, _Shards] = {}  # id(the sharded module) -> its tensors, found on the main thread
        # What a rejoining group receives of the models and optimizers: this rank's shards, read without
        # FSDP's state dict hooks (the rest goes as FaultTolerance sends it with DDP)
        ft.send_parts, ft.receive_parts = self._send_parts, self._receive_parts

    # ------------------------------------------------------------------ modules
    def wrap_model(self, model: torch.nn.Module, parts: ModelParts) -> torch.nn.Module:
        model = super().wrap_model(model, parts)
        hook = _across_groups(self.ft)
        for module in parts.inner.modules():
            if _is_fsdp(module):
                module.set_all_reduce_hook(hook)
        return model

    def setup_module(
        self, module: torch.nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        module = super().setup_module(module, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._find_shards(unwrap_compiled(module))
        return module

    def _find_shards(self, inner: torch.nn.Module) -> None:
        if _is_fsdp(inner):
            self._shards[id(inner)] = _Shards(inner)

    def load_model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        result = super().load_model_state_dict(module, state_dict, strict)
        self._find_shards(self.unwrap(module))  # a load may have put new tensors in
        return result

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizers = one_optimizer(self._optimizers)
        # not scaled: FSDP's ShardedGradScaler unscales and checks inf/NaN over the group (all its ranks alike)
        return CommitGate(self.ft, super().setup_optimizer(optimizer))

    # ------------------------------------------------------------------ what a rejoining group receives
    def _send_parts(self) -> tuple[list[Any], list[Any]]:
        """Called on torchft's quorum thread: this rank's shards of the models and optimizers."""
        from hasten.strategies import unwrap_any

        models = []
        for model in self.ft.registry.models:
            inner = unwrap_any(model)
            shards = self._shards.get(id(inner))
            models.append(shards.read() if shards is not None else inner.state_dict())
        with torch.no_grad():
            optimizers = [_to_local(o.state_dict()) for o in self.ft.registry.optimizers]
        return models, optimizers

    def _receive_parts(self, models: list[Any], optimizers: list[Any]) -> None:
        """Called on the main thread (``should_commit``) of a healing group, with what the same rank
        of its peer group sent: the shards here."""
        from hasten.strategies import unwrap_any

        registry = self.ft.registry
        with torch.no_grad():
            for model, sd in zip(registry.models, models, strict=True):
                inner = unwrap_any(model)
                shards = self._shards.get(id(inner))
                if shards is None:
                    inner.load_state_dict(sd)
                else:
                    shards.write(sd)
        for optimizer, sd in zip(registry.optimizers, optimizers, strict=True):
            optimizer.load_state_dict(_from_local(sd, optimizer))


def _across_groups(ft: FaultTolerance) -> Any:
    """FSDP's all-reduce hook: this process's gradient shard of one FSDP unit, averaged over the
    replica groups (``Manager.allreduce``; a failed reduction is reported to the manager, and the
    step then does not commit)."""

    def hook(reduce_output: torch.Tensor) -> None:
        ft.start_quorum()  # a loop that steps before it zeroes: the first step's quorum
        ft.manager.allreduce(reduce_output).wait()

    return hook


class _Shards:
    """A sharded model's state dict entries, found once on the main thread while FSDP2 holds the
    sharded parameters: each key's parameter (the DTensor FSDP keeps and the optimizer steps) or
    its buffer's module and name (buffers are not sharded)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        params = dict(module.named_parameters(remove_duplicate=False))
        self.entries: dict[str, Any] = {}
        for key in module.state_dict():
            if key in params:
                self.entries[key] = params[key]
                continue
            owner, _, name = key.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            if name not in holder._buffers:
                raise ValueError(
                    f"FaultToleranceKwargs with FSDP heals a group's parameters and buffers shard by shard; the "
                    f"model's state dict also has {key!r} (extra state), which it cannot send"
                )
            self.entries[key] = (holder, name)

    def _tensor(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        return entry if isinstance(entry, torch.Tensor) else entry[0]._buffers[entry[1]]

    def read(self) -> dict[str, Any]:
        with torch.no_grad():
            return {key: _to_local(self._tensor(key)) for key in self.entries}

    def write(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.entries):
            missing, extra = sorted(set(self.entries) - set(state)), sorted(set(state) - set(self.entries))
            raise RuntimeError(
                f"FaultToleranceKwargs: the state a peer group sent does not match this model (missing {missing}, "
                f"unexpected {extra}): every replica group must train the same model"
            )
        for module in self.module.modules():
            if _is_fsdp(module):
                module.reshard()  # the sharded parameters registered, nothing gathered left over
        for key, value in state.items():
            target = self._tensor(key)
            local = target.to_local() if hasattr(target, "to_local") else target
            value = value["local"] if isinstance(value, dict) and value.get(_SHARD) else value
            if local.shape != value.shape:
                raise RuntimeError(
                    f"FaultToleranceKwargs: {key!r}'s shard from the peer group has shape {tuple(value.shape)}, "
                    f"this process's {tuple(local.shape)}: every replica group must run the same number of processes"
                )
            local.copy_(value)


def _to_local(obj: Any) -> Any:
    """``obj`` (a state dict) with each DTensor as its local shard, placements and global shape."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        shard = {"local": obj.to_local(), "placements": tuple(obj.placements), "shape": tuple(obj.shape)}
        return {_SHARD: True, **shard, "stride": tuple(obj.stride())}
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _from_local(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict from :func:`_to_local` with DTensors again, each on the mesh of the
    parameter it belongs to in ``optimizer`` (the parameters' order is the state dict's)."""
    from torch.distributed.tensor import DTensor

    params: dict[Any, torch.Tensor] = {}
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        params.update(zip(saved["params"], group["params"], strict=True))

    def rebuild(value: Any, param: torch.Tensor) -> Any:
        if not (isinstance(value, dict) and value.get(_SHARD)):
            return value
        return DTensor.from_local(
            value["local"].to(param.device),
            param.device_mesh,
            value["placements"],
            run_check=False,
            shape=torch.Size(value["shape"]),
            stride=value["stride"],
        )

    per_param = {
        index: {k: rebuild(v, params[index]) for k, v in entry.items()} for index, entry in state["state"].items()
    }
    return {**state, "state": per_param}
