"""Pipeline parallelism at run time: the split step of the parallelize pipeline, the prepared
model (:class:`PipelineModule`) and its step, and the strategy around another one
(``strategy.PipelineStrategy``) that makes checkpoints, state dicts and clipping see the
whole model.

With ``ParallelismConfig(pp_size=p)`` each process holds the stages torch's schedule places on
its rank of the ``pp`` dim (``TorchPipelineParallelConfig``). ``prepare`` cuts the user's model in
place down to those stages (:func:`apply_pipeline_split`, after fp8's conversion and before
tensor parallelism, as torchtitan does): the rank's part keeps the whole model's module names,
so its ``state_dict()`` keys are the whole model's (``split.py``). Each stage is a view of that
part (the same modules) that the rest of the pipeline treats as a model of its own: tensor
parallelism, activation checkpointing, compilation of each block, then the wrapped strategy's
wrapper on the data dims (FSDP/HSDP; replicas alone: FSDP with shards of one). torch's
``PipelineStage`` and schedule run the views (:meth:`PipelineModule.step`, built once per input
shape).

What the user gets: a :class:`PipelineModule`, whose ``module`` (what ``unwrap_model`` returns)
is the rank's part of their model; ``Accelerator.pipeline_step`` runs forward and backward over
every microbatch. Checkpoints use the "dcp" layout: each process saves its stages' tensors
under the whole model's names, so a checkpoint loads at any shape, with or without a pipeline.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.pipeline import TorchPipelineParallelConfig
    from hasten.strategies.pipeline_parallel.split import SplitPlan

__all__ = ["PipelineModule", "PipelinePlan", "Split", "apply_pipeline_split", "materialise_stages", "pipeline_of"]


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline parallelism on the mesh's ``pp`` dim: which stages this process holds."""

    config: TorchPipelineParallelConfig
    #: the ``pp`` dim of the run's mesh
    mesh: Any
    num_stages: int
    #: the stages this process holds, in order (torch's placement: a loop, or a V)
    stage_ids: tuple[int, ...]
    device: torch.device

    @classmethod
    def build(cls, config: TorchPipelineParallelConfig, pp_mesh: Any, device: torch.device) -> PipelinePlan:
        from hasten.strategies.pipeline_parallel.split import stage_indices

        size, rank = pp_mesh.size(), pp_mesh.get_local_rank()
        num_stages, _ = config.stages(size)
        return cls(config, pp_mesh, num_stages, stage_indices(config.style, num_stages, size, rank), device)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @functools.cached_property
    def last_stage_rank(self) -> int:
        """The global rank on this process's ``pp`` group that holds the last stage."""
        from hasten.strategies.pipeline_parallel.split import stage_indices

        size = self.mesh.size()
        ranks = self.mesh.mesh.flatten().tolist()
        owner = next(
            r for r in range(size) if self.num_stages - 1 in stage_indices(self.config.style, self.num_stages, size, r)
        )
        return ranks[owner]


@dataclass
class Split:
    """A model cut down to this process's stages (``module``, the user's object) and a view of
    it per stage (``views``, sharing its modules), with each view's blocks (FSDP's units)."""

    module: nn.Module
    plan: SplitPlan
    stage_ids: tuple[int, ...]
    views: list[nn.Module]
    blocks: list[list[nn.Module]]
    #: the whole model's tensor table (state-dict keys -> shape, dtype), for checkpoints
    whole_table: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the same for every parameter and buffer (first names), for the main process's broadcast
    whole_tensors: dict[str, dict[str, Any]] = field(default_factory=dict)

    def share_buffers(self) -> None:
        """The model's own buffers (not in a submodule) are the same tensors in every view
        (moving or allocating them replaces them in one)."""
        for view in self.views:
            for name, buffer in self.module._buffers.items():
                view._buffers[name] = buffer


def apply_pipeline_split(
    module: nn.Module,
    plan: PipelinePlan,
    split: SplitPlan,
    blocks: list[nn.Module],
    swaps: Any,
    on_meta: Any,
) -> Split:
    """Cut ``module`` in place down to this process's stages (``split``: where each starts, from
    ``parallelize.plan_stages``) and build a view per stage; the parameters of other stages leave
    any optimizer built before ``prepare`` (``swaps``: the pipeline's ``ParamSwaps``).
    Where the main process sends every value (``on_meta``'s "broadcast"), it keeps the whole
    model's buffers aside first."""
    from hasten.checkpoint.weights import tensor_table
    from hasten.strategies import materialise as mat
    from hasten.strategies.pipeline_parallel.split import build_stage

    whole = tensor_table(module.state_dict(keep_vars=True))
    every = tensor_table(mat.tensor_names(module)[1])
    if on_meta is not None and on_meta.survey.source == "broadcast" and on_meta.values is not None:
        for name, t in mat.tensor_names(module)[1].items():
            if name not in on_meta.values and not isinstance(t, nn.Parameter) and not t.is_meta:
                on_meta.values[name] = t.detach()
    before = list(module.parameters())
    build_stage(module, split, plan.stage_ids, copy=False)
    views = [build_stage(module, split, index, copy=True, share=True) for index in plan.stage_ids]
    kept = {id(p) for p in module.parameters()}
    if swaps is not None:
        swaps.drop(p for p in before if id(p) not in kept)
    stage_blocks = []
    for view in views:
        present = {id(m) for m in view.modules()}
        stage_blocks.append([b for b in blocks if id(b) in present])
    return Split(module, split, plan.stage_ids, views, stage_blocks, whole, every)


def materialise_stages(split: Split, on_meta: Any, plan: Any) -> None:
    """Where FSDP sharded the stages on the meta device: each stage's shards allocated (each
    view is an FSDP root), then filled once, on this process's part, from where the survey said
    (the main process sends the whole model's tensors in its order: every process takes part in
    each broadcast, keeping what its stages hold); then every process waits for the others."""
    import torch.distributed as dist

    from hasten.strategies import materialise as mat

    if on_meta is not None:
        m = plan.materialise
        for view in split.views:
            mat.materialise(view, m.param_device, m.device)
        split.share_buffers()
        names = set(mat.tensor_names(split.module)[1])
        found = on_meta.survey._replace(
            params=on_meta.survey.params & names, meta_buffers=on_meta.survey.meta_buffers & names
        )
        mat.fill(split.module, found, on_meta.values, m.device, m.is_main_process, m.init_fn, whole=split.whole_tensors)
        unfilled = getattr(split.module, mat.UNFILLED, None)
        for view in split.views:
            mat.mark_unfilled(view, set(unfilled or ()))
    dist.barrier()


# ---------------------------------------------------------------------------- the model
class PipelineModule(nn.Module):
    """What ``prepare`` returns with pipeline parallelism: this process's part of the model
    (``module``: the user's module holding only its stages, under the whole model's names) and
    the stages torch runs. Its forward is refused (a process holds part of the model): train with
    ``Accelerator.pipeline_step``."""

    #: a wrapper whose ``module`` is the user's (``strategies.base.strip_wrappers`` opens it)
    _hasten_wrapper = True

    def __init__(self, split: Split, stages: list[nn.Module], plan: PipelinePlan) -> None:
        super().__init__()
        self.module = split.module
        # not registered: they share the modules of ``module`` (its names are the state dict's)
        self.__dict__["_stages"] = list(stages)
        self.__dict__["_pipeline"] = plan
        self.__dict__["_whole_table"] = split.whole_table
        self.__dict__["_schedules"] = collections.OrderedDict()
        self.__dict__["_loss"] = None
        self.__dict__["_targets"] = None

    @property
    def stages(self) -> list[nn.Module]:
        """The stage modules torch runs (wrapped by the data-parallel strategy), in stage order."""
        return list(self._stages)

    @property
    def pipeline(self) -> PipelinePlan:
        return self._pipeline

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"a model prepared with pipeline parallelism (ParallelismConfig.pp_size={self._pipeline.mesh.size()}) "
            f"holds only stage(s) {list(self._pipeline.stage_ids)} of {self._pipeline.num_stages} on this process, so "
            "it cannot run a forward alone: train with loss = accelerator.pipeline_step(model, inputs, targets, "
            "loss_fn), which runs forward and backward of every microbatch through all stages"
        )

    def train(self, mode: bool = True) -> PipelineModule:
        super().train(mode)
        for stage in self._stages:
            stage.train(mode)
        return self

    # ------------------------------------------------------------------ the step
    def step(self, inputs: Any, targets: Any, loss_fn: Callable[..., torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of the batch ``inputs`` (a tensor or a tuple of tensors, the
        model's positional arguments) through every stage, microbatch by microbatch as the
        schedule orders them; ``loss_fn(output, target)`` is each microbatch's mean loss, times
        ``scale`` for the backward. Gradients are the batch mean's (each microbatch's loss is
        divided by their number), added to those already there (accumulation over several
        calls). Under ``torch.no_grad()`` the forward only.
        Returns the batch's mean loss, a 0-dim tensor, the same on every process of the pipeline."""
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not args or not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError(
                "pipeline_step takes the model's inputs as a tensor or a tuple of tensors (the positional "
                f"arguments of the first stage), got {type(inputs).__name__}"
            )
        batch = args[0].shape[0] if args[0].dim() else 0
        targets, self.__dict__["_targets"] = _chunkable_targets(targets, batch)
        training = torch.is_grad_enabled()
        schedule, microbatches, stages = self._schedule(args, training)
        # each microbatch's loss divided by their number: gradients add up to the batch mean's
        # (torch's own scale_grads divides the gradients instead, those of earlier calls too)
        factor = scale / microbatches
        self.__dict__["_loss"] = (loss_fn, factor)
        plan = self._pipeline
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if plan.has_last:
            kwargs = {"target": targets, "losses": losses}
        run = schedule.step if training else schedule.eval
        try:
            run(*(args if plan.has_first else ()), **kwargs)
        finally:
            self.__dict__["_loss"] = self.__dict__["_targets"] = None
            # what torch frees at this schedule's next step (its outputs, the gradients of its
            # receive buffers), freed now: a kept schedule holds only its buffers until then
            for stage in stages:
                stage.clear_runtime_states()
            if self.__dict__.pop("_evicted", False):  # a new shape beyond those kept
                _give_back_freed_memory()
        return self._batch_loss(losses, factor)

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss_fn, factor = self._loss
        if self._targets is not None:  # targets that are not one tensor: ``target`` holds the rows' indices
            target = _rows(self._targets, target)
        return loss_fn(output, target) * factor

    def _batch_loss(self, losses: list[torch.Tensor], factor: float) -> torch.Tensor:
        import torch.distributed as dist

        plan = self._pipeline
        if plan.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean() / factor
        else:
            loss = torch.zeros((), dtype=torch.float32)
        loss = loss.to(plan.device)
        dist.broadcast(loss, src=plan.last_stage_rank, group=plan.mesh.get_group())
        return loss

    def _schedule(self, args: tuple[torch.Tensor, ...], training: bool) -> tuple[Any, int, list[Any]]:
        """torch's schedule for batches of this shape, its number of microbatches and its stages,
        built once (its stages infer the shapes they send on their first run). The
        :data:`SCHEDULES_KEPT` shapes used last are kept; an older one is built again when it comes
        back. Every process of the pipeline sees the same shapes in the same order, so all keep the
        same ones. After a step that evicted one, the memory the allocator kept is given back to
        the system (:func:`_give_back_freed_memory`)."""
        key = (tuple((tuple(a.shape), a.dtype) for a in args), training)
        found = self._schedules.get(key)
        if found is not None:
            self._schedules.move_to_end(key)
            return found
        while len(self._schedules) >= SCHEDULES_KEPT:
            self._schedules.popitem(last=False)  # its stages' buffers go with it
            self.__dict__["_evicted"] = True
        found = self._schedules[key] = self._build_schedule(args[0].shape[0] if args[0].dim() else 0)
        return found

    def _build_schedule(self, batch_size: int) -> tuple[Any, int, list[Any]]:
        from torch.distributed.pipelining import PipelineStage

        from hasten.settings.pipeline import check_microbatches

        plan = self._pipeline
        microbatches = check_microbatches(plan.config, plan.num_stages, batch_size, plan.mesh.size())
        group = plan.mesh.get_group()
        stages = [
            PipelineStage(stage, index, plan.num_stages, plan.device, group=group)
            for index, stage in zip(plan.stage_ids, self._stages)
        ]
        if _SELF_SEND_IN_WARMUP:
            for stage in stages:
                _skip_sends_to_self(stage)
        cls = plan.config.schedule_class()
        first = stages[0] if plan.config.single_stage else stages
        schedule = cls(first, n_microbatches=microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        return schedule, microbatches, stages


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: another C library, another system)."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _give_back_freed_memory() -> None:
    """Return the memory glibc's allocator keeps after frees to the system (``malloc_trim(0)``).

    Each input shape allocates activations and buffers of its own size; glibc keeps what they
    free (its threshold for giving large blocks straight back rises with the largest freed), so
    over many shapes a process's RSS grows by what it no longer holds (a loop without a pipeline
    too). Called after a step that evicted a schedule (a new shape beyond those kept, which
    builds a schedule, a far larger cost), never at a step that reuses one."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: torch 2.11's schedules open the stages' links with a send and a receive between neighbouring
#: stages, a process to itself too where two of its stages are neighbours (the V schedules,
#: ZBVZeroBubble and DualPipeV), which gloo cannot do ("Pair is not connected"); 2.12 warms up otherwise.
_SELF_SEND_IN_WARMUP = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 12)


def _skip_sends_to_self(stage: Any) -> None:
    """Leave out ``stage``'s warm-up sends and receives to its own process (both ends are here,
    and the schedule hands the tensors between them without a send)."""
    make = stage._get_init_p2p_neighbors_ops

    def ops() -> list[Any]:
        return [op for op in make() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops


#: how many input shapes keep their schedule (each holds its stages' send/receive buffers, sized
#: for that shape): a shape beyond them evicts the least recently used one
SCHEDULES_KEPT = 8


def _chunkable_targets(targets: Any, batch: int) -> tuple[Any, Any]:
    """What torch's schedule splits into microbatches (it splits one tensor along dim 0), and the
    targets to take rows from: a tensor goes as it is (None); anything else (a dict, a tuple, a
    nested structure of tensors, as the loss function takes them) is replaced by its row indices,
    and each microbatch's loss gets those rows of every tensor in it."""
    if isinstance(targets, torch.Tensor):
        return targets, None
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(targets) if isinstance(t, torch.Tensor)]
    wrong = [tuple(t.shape) for t in leaves if t.dim() == 0 or t.shape[0] != batch]
    if not leaves or wrong:
        raise TypeError(
            "pipeline_step.targets must be a tensor, or a dict/tuple/list of tensors whose first dim is the "
            f"batch's ({batch} rows, as the inputs'), got {type(targets).__name__}"
            + (f" holding tensors of shapes {wrong[:3]}" if wrong else " holding no tensor")
        )
    return torch.arange(batch), targets


def _rows(targets: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` (a contiguous run, as torch's split makes) of every tensor in ``targets``."""
    from torch.utils._pytree import tree_map

    lo, hi = int(index[0]), int(index[-1]) + 1
    return tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, targets)


def pipeline_step(
    model: Any,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    accumulation_steps: int,
    backward: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """``Accelerator.pipeline_step``: through the pipeline's schedule where ``model`` is a
    :class:`PipelineModule`, else forward, ``loss_fn`` and ``backward`` (the Accelerator's), so one
    loop runs at any shape. The loss of the backward is divided by ``accumulation_steps``."""
    if not callable(loss_fn):
        raise TypeError(f"pipeline_step.loss_fn must be callable as loss_fn(output, targets), got {loss_fn!r}")
    pipeline = pipeline_of(model)
    if pipeline is not None:
        return pipeline.step(inputs, targets, loss_fn, scale=1.0 / accumulation_steps)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"pipeline_step.model must be a prepared torch.nn.Module, got {type(model).__name__}")
    loss = loss_fn(model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,))), targets)
    if torch.is_grad_enabled():
        backward(loss)
    return loss.detach()


def pipeline_of(model: Any) -> PipelineModule | None:
    """The :class:`PipelineModule` ``model`` is (a prepared model with pipeline parallelism), else None."""
    return model if isinstance(model, PipelineModule) else None
