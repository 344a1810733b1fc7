"""Pipeline parallelism's strategy: :class:`PipelineStrategy`, around the strategy of the data
dims, makes state dicts, checkpoints and clipping see the whole model across the ``pp`` group
(each process holds its stages' part, under the whole model's names: see
``hasten.strategies.pipeline_parallel.schedule``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from hasten.strategies.base import Strategy, by_names, has_dtensor, keyed_by_ids, param_names
from hasten.strategies.pipeline_parallel.schedule import PipelineModule, PipelinePlan

__all__ = ["PipelineStrategy"]


# ---------------------------------------------------------------------------- the strategy
class PipelineStrategy(Strategy):
    """Pipeline parallelism around the strategy of the data dims (``inner``: FSDP/HSDP, FSDP with
    shards of one for replicas alone, or none): ``prepare`` splits each model (the plan's ``pipeline``) and the
    inner strategy wraps each stage; state dicts, checkpoints and clipping then see the whole
    model across the ``pp`` group. Checkpoints use the "dcp" layout, whatever the inner one."""

    checkpoint_layout = "dcp"

    def __init__(self, inner: Strategy, pipeline: PipelinePlan) -> None:
        import dataclasses

        self.inner = inner
        self.state = inner.state
        self.precision = inner.precision
        self.pipeline = pipeline
        inner.plan = dataclasses.replace(inner.plan, pipeline=pipeline)
        self.name = f"pipeline+{inner.name}"
        self.distributed_type = inner.distributed_type
        self._models: list[nn.Module] = []  # this process's part of each prepared model
        self._prepared: list[nn.Module] = []  # each prepared model (its pipeline module)

    plan = property(lambda self: self.inner.plan)
    swaps = property(lambda self: self.inner.swaps)

    @plan.setter
    def plan(self, value: Any) -> None:
        self.inner.plan = value

    # ------------------------------------------------------------------ modules
    def setup_module(
        self, module: nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> nn.Module:
        if isinstance(module, PipelineModule):
            return module
        prepared = self.inner.setup_module(module, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if not evaluation_mode:
            self._models.append(self.unwrap(prepared))
            self._prepared.append(prepared)
        return prepared

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.inner.setup_optimizer(optimizer)

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """torch's stages reduce the gradients of each ``pipeline_step`` themselves (after its last
        microbatch): accumulating over several calls reduces at each, with the same result."""
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _inner(self, module: nn.Module) -> nn.Module | None:
        return module.module if isinstance(module, PipelineModule) else self.inner._inner(module)

    # ------------------------------------------------------------------ state dicts
    def _rank_keys(self, module: nn.Module) -> set[str]:
        return set(self.unwrap(module).state_dict().keys())

    def model_state_dict(self, module: nn.Module, full: bool = True, *, check_filled: bool = True) -> dict[str, Any]:
        """Not full: this process's stages (DTensor shards where sharded), under the whole
        model's names. Full: the whole model on the main process (empty elsewhere), each stage
        gathered over its data dims, then sent over the ``pp`` group."""
        local = self.inner.model_state_dict(module, full=False, check_filled=check_filled)
        if not full:
            return local
        whole = self._gather_whole(_full_tensors(local))
        order = getattr(module, "_whole_table", None) or {}
        return {k: whole[k] for k in order if k in whole} | {k: v for k, v in whole.items() if k not in order}

    def load_model_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Each process loads its stages' entries of a whole model's state dict (full or sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from hasten.strategies.base import own_keys
        from hasten.strategies.materialise import mark_filled

        inner = self.unwrap(module)
        mine = self._rank_keys(module)
        whole = set(getattr(module, "_whole_table", {}) or mine)
        state_dict = own_keys(state_dict, whole)
        if strict:
            unknown = sorted(k for k in state_dict if k not in whole)
            missing = sorted(k for k in mine if k not in state_dict)
            if unknown or missing:
                raise RuntimeError(
                    f"load_state_dict for the pipeline stage(s) of {type(inner).__name__}: missing keys {missing[:5]}, "
                    f"keys the whole model does not have {unknown[:5]}"
                )
        part = {k: v for k, v in state_dict.items() if k in mine}
        full = not has_dtensor(part)
        result = set_model_state_dict(inner, part, options=StateDictOptions(full_state_dict=full, strict=False))
        mark_filled(inner, part.keys())
        refresh = getattr(self.inner, "refresh_float8", None)
        if refresh is not None:
            refresh(inner)
        return result

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, full: bool = True) -> dict[str, Any]:
        """Keyed by parameter names, with every stage's ``param_groups`` (the same on every
        process, so the DCP file holds the whole model's groups); full: the whole state on the
        main process."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model = self._model_of(optimizer)
        opt = getattr(optimizer, "optimizer", optimizer)
        local = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
        local = self.plain(local)
        groups = self._merged_groups(local["param_groups"])
        if not full:
            return {"state": local["state"], "param_groups": groups}
        whole = self._gather_whole(_full_tensors(local["state"]))
        return {"state": whole, "param_groups": groups} if whole or self.state.is_main_process else {}

    def optimizer_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        """Each group's parameter names over every stage (a collective over the ``pp`` group), in
        the whole model's order: a one-process optimizer built on ``model.parameters()`` lists
        them so, which is what its state dict's indices count."""
        model = self._model_of(optimizer)
        opt = getattr(optimizer, "optimizer", optimizer)
        names = param_names(model)
        merged = self._merged_groups([{"params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups])
        order = {k: i for i, k in enumerate(getattr(self._prepared_of(model), "_whole_table", None) or {})}
        return [sorted(g["params"], key=lambda n: order.get(n, len(order))) for g in merged]

    def _prepared_of(self, part: nn.Module) -> Any:
        """The prepared model (the pipeline module, which knows the whole model's table) of ``part``."""
        return next((m for m in self._prepared if self.unwrap(m) is part), None)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """``state_dict`` keyed by the whole model's parameter names (full, or sharded), or by
        index (a one-process or DDP checkpoint's; its names found with a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if keyed_by_ids(state_dict):
            state_dict = by_names(state_dict, self.optimizer_names(optimizer))
        model = self._model_of(optimizer)
        opt = getattr(optimizer, "optimizer", optimizer)
        mine = {name for name, _ in model.named_parameters()}
        state = {k: v for k, v in state_dict.get("state", {}).items() if k in mine}
        groups = [{**g, "params": [p for p in g["params"] if p in mine]} for g in state_dict.get("param_groups", [])]
        if not any(g["params"] for g in opt.param_groups):  # stages without parameters: the hyperparameters alone
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        full = not has_dtensor(state)
        set_optimizer_state_dict(
            model, opt, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=full)
        )

    def _model_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The prepared model (this process's part) whose parameters ``optimizer`` updates."""
        opt = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for g in opt.param_groups for p in g["params"]}
        owners = [m for m in self._models if any(id(p) in mine for p in m.parameters())]
        if not mine:  # this process's stages hold no parameter (the optimizer lost the others' at the split)
            owners = [m for m in self._models if next(m.parameters(), None) is None] or owners
            owners = owners[:1]  # any part without parameters saves the same (nothing)
        if len(owners) != 1:
            raise ValueError(
                "with pipeline parallelism hasten checkpoints an optimizer with its one prepared model: "
                f"this optimizer updates the parameters of {len(owners)} prepared models"
            )
        return owners[0]

    def _merged_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``param_groups`` with the parameter names of every stage (gathered over the ``pp`` group)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.pipeline.mesh.size()
        dist.all_gather_object(everyone, [list(g["params"]) for g in groups], group=self.pipeline.mesh.get_group())
        merged = []
        for i, group in enumerate(groups):
            names = [n for stage in everyone for n in (stage[i] if i < len(stage) else [])]
            merged.append({**group, "params": list(dict.fromkeys(names))})
        return merged

    def _gather_whole(self, part: dict[str, Any]) -> dict[str, Any]:
        """Every stage's ``part`` (CPU tensors) merged on the main process (empty elsewhere)."""
        import torch.distributed as dist

        group = self.pipeline.mesh.get_group()
        ranks = self.pipeline.mesh.mesh.flatten().tolist()
        if 0 not in ranks:
            return {}  # another data/tensor-parallel rank's pipeline: the main process gathers its own
        gathered: list[Any] = [None] * len(ranks) if self.state.is_main_process else None
        dist.gather_object(part, gathered, dst=0, group=group)
        if not self.state.is_main_process:
            return {}
        whole: dict[str, Any] = {}
        for stage in gathered:
            whole.update(stage)
        return whole

    def whole_tensor_table(self, module: nn.Module, table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The whole model's tensor table (what a checkpoint records), from this process's part."""
        return dict(getattr(module, "_whole_table", None) or table)

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of every stage's gradients (each stage's norm over its data and
        tensor-parallel dims, combined over the ``pp`` group); the same tensor on every process."""
        from hasten.strategies.tensor_parallel import clip_grad_norm_

        return clip_grad_norm_(parameters, max_norm, norm_type, pp_group=self.pipeline.mesh.get_group())

    def __repr__(self) -> str:
        return f"PipelineStrategy(stages={list(self.pipeline.stage_ids)} of {self.pipeline.num_stages}, {self.inner!r})"


def _full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each DTensor gathered to a full tensor, everything on the CPU (nested dicts too)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _full_tensors(value)
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor().cpu()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu()
        else:
            out[key] = value
    return out
