"""The parallelize pipeline: what ``prepare`` does to a model, in one function, top to bottom.

:func:`parallelize` applies the steps in torchtitan's order (``torchtitan/models/*/parallelize.py``):
tensor parallelism, sequence parallelism (the attention wrapped in an all-to-all), expert
parallelism (the experts split, tokens dispatched by all-to-all), activation checkpointing,
compilation of each block, then the strategy's wrapper (FSDP/HSDP's ``fully_shard`` or DDP),
then materialising the sharded model and initialising or loading its numbers. Each step is a
small ``apply_*`` function that takes its part of a :class:`ParallelizePlan`: a frozen
description of what was decided once, when the Accelerator chose its strategy; a step whose part
is None does nothing.

Sharding happens where the model was built (see ``materialise``): a model that FSDP shards over
several processes moves to the meta device first (its values kept aside, where they are needed),
so that the steps run on the meta device and only this process's shards are ever allocated.

Adding a parallelism or a precision: one ``apply_*`` step here and one field of the plan.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.handlers import DistributedDataParallelKwargs
    from hasten.settings.plugins import FullyShardedDataParallelPlugin
    from hasten.strategies.expert_parallel import ExpertParallelPlan
    from hasten.strategies.materialise import Survey
    from hasten.strategies.pipeline_parallel.schedule import PipelinePlan, Split
    from hasten.strategies.pipeline_parallel.split import SplitPlan
    from hasten.strategies.sequence_parallel import SequenceParallelPlan
    from hasten.training.compile import Compiler
    from hasten.training.float8 import Float8Plan
    from hasten.training.precision import Precision


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class BlockPolicy:
    """Which submodules are units of their own (FSDP's ``auto_wrap_policy``, resolved): each is
    sharded on its own, checkpointed, and compiled on its own where FSDP shards."""

    #: "transformer_based_wrap", "size_based_wrap", "no_wrap" or a callable ``policy(module) -> bool``
    policy: str | Callable[[nn.Module], bool]
    #: the class names "transformer_based_wrap" picks
    class_names: tuple[str, ...] = ()
    #: the parameters a block of "size_based_wrap" holds at least
    min_num_params: int | None = None


@dataclass(frozen=True)
class TensorParallelPlan:
    """Tensor parallelism on the mesh's ``tp`` dim."""

    #: the ``tp`` dim of the run's mesh
    mesh: Any
    #: ``ParallelismConfig.tp_plan`` (None: the model's own plan)
    given: Mapping[str, str] | None = None


@dataclass(frozen=True)
class CheckpointingPlan:
    """Activation checkpointing of each block (each top-level child without blocks): full or
    selective (the wrapper says), or ``torch.compile``'s memory budget (no wrapper)."""

    #: the wrapper torch's ``apply_activation_checkpointing`` puts around each checkpointed block
    #: (None under a memory budget)
    wrapper: Callable[..., nn.Module] | None
    #: checkpoint one block in n (torchtitan's layer-selective checkpointing)
    every_nth_block: int = 1
    #: ``torch._functorch.config.activation_memory_budget`` for the compiled graphs (None: unchanged)
    memory_budget: float | None = None

    @classmethod
    def from_plugin(
        cls, plugin: FullyShardedDataParallelPlugin, pin_memory: bool, compiler: Compiler | None
    ) -> CheckpointingPlan | None:
        """The plugin's ``activation_checkpointing`` (None: off); a memory budget without
        ``torch.compile`` is refused, naming why."""
        config = plugin.activation_checkpointing_config
        if config is None:
            return None
        if not config.wraps:
            if compiler is None:
                raise ValueError(
                    "FullyShardedDataParallelPlugin.activation_checkpointing=ActivationCheckpointingConfig("
                    f"mode='memory_budget', memory_budget={config.memory_budget}) is applied by torch.compile's "
                    "partitioner, but nothing is compiled: pass a TorchDynamoPlugin (or dynamo_backend=...), or use "
                    "mode 'full' or 'selective'"
                )
            return cls(None, memory_budget=config.memory_budget)
        return cls(plugin.checkpoint_wrapper(pin_memory), every_nth_block=config.every_nth_block)


@dataclass(frozen=True)
class ShardingPlan:
    """FSDP2 (``fully_shard``) over several processes: the arguments of every call."""

    #: ``MixedPrecisionPolicy`` of the blocks, and of the root (its outputs in fp32 where derived)
    mp_policy: Any
    root_mp_policy: Any
    #: ``OffloadPolicy`` or ``CPUOffloadPolicy``
    offload_policy: Any
    reshard_after_forward: bool | int
    #: modules (or a regular expression on module names) whose parameters are not sharded
    ignored_modules: str | tuple[nn.Module, ...] | None = None


@dataclass(frozen=True)
class MaterialisePlan:
    """How a model moved to (or built on) the meta device gets real tensors and numbers."""

    #: the processes that agree on where the numbers come from (``materialise.survey``)
    num_processes: int
    is_main_process: bool
    #: where buffers and unsharded parameters go
    device: torch.device
    #: where the sharded parameters go (the CPU with ``cpu_offload``)
    param_device: torch.device
    #: ``param_init_fn(module)`` (None: each module's ``reset_parameters``)
    init_fn: Callable[[nn.Module], Any] | None = None


@dataclass(frozen=True)
class DDPPlan:
    """DistributedDataParallel: the handler gives DDP's arguments and registers its hook."""

    handler: DistributedDataParallelKwargs
    #: DDP's ``device_ids`` (None: the CPU)
    device_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ParallelizePlan:
    """What ``prepare`` does to every model, decided once when the Accelerator chose its
    strategy (the last two fields for one ``prepare_model`` call, see :meth:`for_call`)."""

    #: where the model runs
    device: torch.device
    #: the autocast forward (where not sharded) and FSDP's policies come from it
    precision: Precision
    #: fp8: which Linear layers become torchao's float8 layers, with which config
    float8: Float8Plan | None = None
    #: pipeline parallelism: the stages this process holds (each then parallelized as a model)
    pipeline: PipelinePlan | None = None
    blocks: BlockPolicy | None = None
    tp: TensorParallelPlan | None = None
    #: Ulysses sequence parallelism on the ``sp`` dim (``sequence_parallel.py``)
    sp: SequenceParallelPlan | None = None
    #: expert parallelism on the ``ep`` dim, the experts then FSDP-sharded on ``efsdp`` (``expert_parallel.py``)
    ep: ExpertParallelPlan | None = None
    activation_checkpointing: CheckpointingPlan | None = None
    compile: Compiler | None = None
    sharding: ShardingPlan | None = None
    ddp: DDPPlan | None = None
    materialise: MaterialisePlan | None = None
    #: move an unsharded model to ``device``
    device_placement: bool = True
    #: inference only: placed, autocast and compiled, never wrapped, sharded or split
    evaluation_mode: bool = False

    def for_call(self, device_placement: bool, evaluation_mode: bool) -> ParallelizePlan:
        """This plan for one ``prepare_model`` call."""
        if not evaluation_mode:
            return dataclasses.replace(self, device_placement=device_placement)
        return dataclasses.replace(
            self,
            device_placement=device_placement,
            evaluation_mode=True,
            tp=None,
            ep=None,
            sharding=None,
            ddp=None,
            materialise=None,
        )

    @property
    def autocast(self) -> Precision | None:
        """The precision whose autocast forward the model gets; None where FSDP shards (its
        ``MixedPrecisionPolicy`` casts instead)."""
        return self.precision if self.sharding is None else None


@dataclass(frozen=True)
class ModelParts:
    """One model as the pipeline found it, for the strategy's wrapper."""

    #: the user's module inside any wrapper (what is sharded in place)
    inner: nn.Module
    #: the units of their own, innermost first (never the root)
    blocks: tuple[nn.Module, ...]
    #: the parameters left unsharded (``ShardingPlan.ignored_modules``), as they were before any step
    ignored: frozenset[nn.Parameter]
    #: expert parallelism's experts modules (FSDP shards them on ``efsdp``, before the blocks)
    experts: tuple[nn.Module, ...] = ()


@dataclass(frozen=True)
class OnMeta:
    """A sharded model's parameters moved to the meta device: where their numbers come from,
    and the values kept aside for that (by first name)."""

    survey: Survey
    values: dict[str, torch.Tensor]


#: the strategy's wrapper: ``wrap(model, parts)`` returns the wrapped model (FSDP shards in place)
Wrap = Callable[[nn.Module, ModelParts], nn.Module]


# ---------------------------------------------------------------------------- the pipeline
def parallelize(
    model: nn.Module, inner: nn.Module, plan: ParallelizePlan, wrap: Wrap, swaps: ParamSwaps | None = None
) -> nn.Module:
    """``model`` (``inner``: the user's module inside it) prepared as ``plan`` says; returns
    what ``prepare`` returns. ``wrap`` is the strategy's wrapper (``fsdp.apply_fsdp``,
    ``ddp.apply_ddp`` or none), called unless the plan is for evaluation. ``swaps`` records the
    parameters the steps replace (for optimizers built before ``prepare``)."""
    blocks = select_blocks(inner, plan.blocks)  # checked against the model on every process count
    tp_styles = resolve_tp(inner, plan.tp)  # checked before anything changes; None: no TP, or adopted
    check_sequence_parallel(inner, plan.sp)  # what Ulysses cannot run, refused before anything changes
    experts = find_experts(inner, plan.ep, plan.compile)  # the experts modules, checked before anything changes
    ignored = ignored_params(inner, plan.sharding)
    stages = plan_stages(inner, plan.pipeline)  # the pipeline split, checked before anything changes
    on_meta = move_to_meta(inner, plan, ignored, adopted=plan.tp is not None and tp_styles is None)
    # float8 conversion: first (on the meta device where sharded), before anything splits a layer
    blocks = apply_float8(inner, plan, blocks, swaps)
    split = apply_pipeline_split(inner, plan.pipeline, stages, blocks, swaps, on_meta)
    if split is not None:  # pipeline stages: the steps below, on each stage
        return parallelize_stages(split, plan, tp_styles, ignored, on_meta, wrap, swaps, experts)
    owners = _by_owner(inner) if swaps is not None and (plan.sharding or plan.tp) else []
    parts = ModelParts(inner, tuple(blocks), ignored, tuple(m for _, m in experts))
    apply_tp(inner, plan.tp, tp_styles, whole=True)
    apply_sequence_parallel(inner, plan.sp, whole=True)
    apply_expert_parallel(experts, plan.ep)
    apply_activation_checkpointing(inner, blocks, plan.activation_checkpointing)
    model = apply_placement(model, inner, plan)  # not sharded: real tensors, on the device
    apply_autocast(inner, plan.autocast)  # not sharded: FSDP's MixedPrecisionPolicy casts there
    compiled = apply_compile(inner, plan.compile, blocks if plan.sharding is not None else [])
    if not plan.evaluation_mode:
        model = wrap(model, parts)  # FSDP/HSDP or DDP: the strategy's own
    apply_materialise(inner, on_meta, plan)
    del on_meta  # the values kept aside: freed once the shards hold them
    if owners:
        swaps.record((old, owner._parameters.get(name)) for owner, name, old in owners)
    return model if compiled or plan.compile is None else plan.compile.compile_whole(model)


def parallelize_stages(
    split: Split,
    plan: ParallelizePlan,
    tp_styles: dict[str, str] | None,
    ignored: frozenset[nn.Parameter],
    on_meta: OnMeta | None,
    wrap: Wrap,
    swaps: ParamSwaps | None,
    experts: Iterable[tuple[str, nn.Module]] = (),
) -> nn.Module:
    """The steps after the pipeline split, on each of this process's stages (views sharing the
    modules of ``split.module``, the user's model cut down to them): tensor parallelism, expert
    parallelism (on the experts modules this process's stages kept), sequence parallelism,
    activation checkpointing, placement, autocast, compilation of each block (a stage is never
    compiled whole: torch's stage must see the data-parallel wrapper), the strategy's wrapper on
    the data dims, then materialising what FSDP sharded on the meta device."""
    from hasten.strategies.pipeline_parallel.schedule import PipelineModule

    owners = _by_owner(split.module) if swaps is not None and (plan.sharding or plan.tp) else []
    kept = {id(m) for m in split.module.modules()}
    apply_expert_parallel([(n, m) for n, m in experts if id(m) in kept], plan.ep)
    for view, blocks in zip(split.views, split.blocks):
        present = {name for name, _ in view.named_modules()}
        apply_tp(view, plan.tp, {k: s for k, s in tp_styles.items() if k in present} if tp_styles else tp_styles)
        apply_sequence_parallel(view, plan.sp)
        apply_activation_checkpointing(view, blocks, plan.activation_checkpointing)
    apply_placement(split.module, split.module, plan)
    split.share_buffers()
    stages = []
    for view, blocks in zip(split.views, split.blocks):
        apply_autocast(view, plan.autocast)
        if plan.compile is not None and not apply_compile(view, plan.compile, blocks):
            apply_compile(view, plan.compile, blocks or list(view.get_submodule(split.plan.container).children()))
        mine = tuple(m for m in view.modules() if any(m is e for _, e in experts))
        stages.append(view if plan.evaluation_mode else wrap(view, ModelParts(view, tuple(blocks), ignored, mine)))
    if plan.sharding is not None:
        from hasten.strategies.pipeline_parallel.schedule import materialise_stages

        materialise_stages(split, on_meta, plan)
    if owners:
        swaps.record((old, owner._parameters.get(name)) for owner, name, old in owners)
    return PipelineModule(split, stages, plan.pipeline)


class ParamSwaps:
    """The parameter that now stands for each one a step of the pipeline replaced (torchao's
    float8 weights, TP's and FSDP's DTensors): an optimizer built before ``prepare`` is pointed
    at the newest (``rebind``). An entry lives as long as the replaced parameter does."""

    def __init__(self) -> None:
        self._newest: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        self._standing_for: dict[int, list[int]] = {}  # id(newest) -> the keys it stands for
        self._dropped: dict[int, weakref.ref] = {}

    def drop(self, params: Iterable[nn.Parameter]) -> None:
        """``params`` left the model (another pipeline stage's): an optimizer forgets them."""
        for p in params:
            self._dropped[id(p)] = weakref.ref(p, self._forget_dropped(id(p)))

    def _forget_dropped(self, key: int) -> Callable[[Any], None]:
        return lambda _: self._dropped.pop(key, None)

    def _was_dropped(self, param: nn.Parameter) -> bool:
        ref = self._dropped.get(id(param))
        return ref is not None and ref() is param

    def record(self, pairs: Iterable[tuple[nn.Parameter, nn.Parameter | None]]) -> None:
        for old, new in pairs:
            if new is None or new is old:
                continue
            # what ``old`` stood for moves on (those still recorded: a dead original's key is gone)
            keys = [k for k in self._standing_for.pop(id(old), []) if k in self._newest] + [id(old)]
            for key in keys:
                ref = self._newest[key][0] if key in self._newest else weakref.ref(old, self._forget(key))
                self._newest[key] = (ref, new)
            self._standing_for.setdefault(id(new), []).extend(keys)

    def _forget(self, key: int) -> Callable[[Any], None]:
        return lambda _: self._newest.pop(key, None)

    def __contains__(self, param: nn.Parameter) -> bool:
        return id(param) in self._newest

    def replaced(self) -> list[nn.Parameter]:
        """The replaced parameters still alive (each stands for its newest replacement)."""
        return [p for ref, _ in self._newest.values() if (p := ref()) is not None]

    def newest(self, param: nn.Parameter) -> nn.Parameter:
        entry = self._newest.get(id(param))
        return param if entry is None else entry[1]

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer``'s groups at the newest parameters (its groups and hyperparameters
        kept), without the parameters the model dropped (another pipeline stage's)."""
        if not (self._dropped or self._newest):
            return
        for group in optimizer.param_groups:
            # a parameter replaced (fp8) before the split dropped its replacement is dropped too
            kept = [p for p in group["params"] if not self._was_dropped(p)]
            group["params"] = [q for q in map(self.newest, kept) if not self._was_dropped(q)]


def _by_owner(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Each parameter with the module holding it and its name there (TP and FSDP replace them there)."""
    return [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]


# ---------------------------------------------------------------------------- the steps
def select_blocks(module: nn.Module, policy: BlockPolicy | None) -> list[nn.Module]:
    """The submodules that are units of their own, innermost first (never the root)."""
    if policy is None:
        return []
    subs = [m for m in _post_order(module) if m is not module]
    if callable(policy.policy):
        return [m for m in subs if policy.policy(m)]
    if policy.policy == "no_wrap":
        return []
    if policy.policy == "transformer_based_wrap":
        from hasten.settings.plugins import wrap_class_names

        wanted = wrap_class_names(module, policy.class_names)  # none given: the model's _no_split_modules
        present = {type(m).__name__ for m in module.modules()}
        missing = [n for n in wanted if n not in present]
        if missing:
            raise ValueError(
                f"FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap names {missing}, which the model "
                f"({type(module).__name__}) does not contain; its module classes are: {', '.join(sorted(present))}"
            )
        return [m for m in subs if type(m).__name__ in wanted]
    # size_based_wrap: a submodule whose parameters not yet in a block reach min_num_params
    taken: set[int] = set()
    blocks = []
    for m in subs:
        params = [p for p in m.parameters() if id(p) not in taken]
        if sum(p.numel() for p in params) >= policy.min_num_params:
            blocks.append(m)
            taken.update(id(p) for p in params)
    return blocks


def ignored_params(module: nn.Module, sharding: ShardingPlan | None) -> frozenset[nn.Parameter]:
    """The parameters FSDP leaves whole (``ShardingPlan.ignored_modules``); none unsharded."""
    ignored = sharding.ignored_modules if sharding is not None else None
    if ignored is None:
        return frozenset()
    if isinstance(ignored, str):
        import re

        modules = [m for n, m in module.named_modules() if re.search(ignored, n)]
    else:
        modules = list(ignored)
    return frozenset(p for m in modules for p in m.parameters())


def resolve_tp(module: nn.Module, plan: TensorParallelPlan | None) -> dict[str, str] | None:
    """The tensor-parallel plan on the module's names (checked); None without TP or for a model
    already parallelised (adopted as it is, never re-wrapped)."""
    if plan is None:
        return None
    from hasten.strategies import tensor_parallel as tp

    if tp.holds_dtensors(module):
        tp.check_adopted(module, plan.mesh)
        return None
    chosen, where = tp.model_plan(module, plan.given)
    return tp.resolve(module, chosen, where)


def move_to_meta(
    module: nn.Module, plan: ParallelizePlan, ignored: frozenset[nn.Parameter], adopted: bool = False
) -> OnMeta | None:
    """Where FSDP shards: where the numbers come from (``survey``, one collective), then every
    parameter but the ignored ones moved to the meta device in place (the optimizer's and tied
    modules' references stay valid); None where nothing moves (not sharded, or a model whose
    DTensors the user made: those are sharded where they are)."""
    if plan.sharding is None or adopted:
        return None
    from hasten.strategies import materialise as mat

    found = mat.survey(module, plan.materialise.num_processes)
    unsharded = {id(p) for p in ignored}
    values = mat.to_meta(module, keep=lambda p: id(p) in unsharded)
    if found.source == "broadcast" and not plan.materialise.is_main_process:
        values = {}  # what this process built is not used: freed here
    return OnMeta(found, values)


def apply_float8(
    module: nn.Module, plan: ParallelizePlan, blocks: list[nn.Module], swaps: ParamSwaps | None
) -> list[nn.Module]:
    """fp8: the chosen ``nn.Linear`` layers become torchao's float8 layers (in place, on the meta
    device where FSDP shards); returns the blocks, found again by name (a block may be a layer
    that was replaced). On gloo, a unit holding only float8-gathered weights gathers them in high
    precision (``float8.gather_in_high_precision``)."""
    if plan.float8 is None:
        return blocks
    from hasten.training import float8

    names = {id(m): n for n, m in module.named_modules()}
    replaced = float8.apply_float8(module, plan.float8)
    found = dict(module.named_modules())
    blocks = [found[names[id(b)]] for b in blocks]
    if plan.sharding is not None:
        replaced += float8.gather_in_high_precision(blocks, module, plan.float8)
    if swaps is not None:
        swaps.record(replaced)
    return blocks


def plan_stages(module: nn.Module, plan: PipelinePlan | None) -> SplitPlan | None:
    """Pipeline parallelism: where each stage starts (``pipeline.split_plan``: split points
    that name no block, more stages than blocks, tied weights across stages are refused here,
    before any step changes the model); None without it."""
    if plan is None:
        return None
    from hasten.strategies.pipeline_parallel.split import split_plan

    return split_plan(module, plan.config.split_points, plan.num_stages)


def apply_pipeline_split(
    module: nn.Module,
    plan: PipelinePlan | None,
    stages: SplitPlan | None,
    blocks: list[nn.Module],
    swaps: ParamSwaps | None,
    on_meta: OnMeta | None,
) -> Split | None:
    """Pipeline parallelism: ``module`` cut in place down to this process's stages, a view per
    stage (``pipeline_parallel.schedule.apply_pipeline_split``); None without it."""
    if plan is None:
        return None
    from hasten.strategies.pipeline_parallel.schedule import apply_pipeline_split as split

    return split(module, plan, stages, blocks, swaps, on_meta)


def apply_tp(
    module: nn.Module, plan: TensorParallelPlan | None, styles: dict[str, str] | None, whole: bool = False
) -> None:
    """Tensor parallelism on the ``tp`` dim (on the meta device: nothing is communicated); on a
    ``whole`` model (not a pipeline stage) its tp ranks' inputs compared at the first forward."""
    if plan is not None:
        from hasten.strategies import tensor_parallel as tp

        if styles:
            tp.apply_plan(module, plan.mesh, styles)
        if whole:
            tp.check_same_inputs(module, plan.mesh)


def check_sequence_parallel(module: nn.Module, plan: SequenceParallelPlan | None) -> None:
    """Sequence parallelism: a transformers model whose attention Ulysses cannot exchange is
    refused here, naming why (``sequence_parallel.check_model``)."""
    if plan is not None:
        from hasten.strategies.sequence_parallel import check_model

        check_model(module, plan)


def apply_sequence_parallel(module: nn.Module, plan: SequenceParallelPlan | None, whole: bool = False) -> None:
    """Sequence parallelism: the model's attention exchanged head-for-sequence inside
    ``maybe_context_parallel`` (``sequence_parallel.apply_sequence_parallel``; a ``whole`` model,
    not a pipeline stage, must exchange in its first forward inside it)."""
    if plan is not None:
        from hasten.strategies.sequence_parallel import apply_sequence_parallel as apply

        apply(module, plan, whole)


def find_experts(
    module: nn.Module, plan: ExpertParallelPlan | None, compile_plan: Any = None
) -> list[tuple[str, nn.Module]]:
    """Expert parallelism: the experts modules (name, module); a model with none, or whose
    experts ``ep_size`` does not divide, is refused here (``expert_parallel.find_experts``), and
    compilation where this torch compiles the experts' dispatch wrongly (``check_compile``)."""
    if plan is None:
        return []
    from hasten.strategies.expert_parallel import check_compile
    from hasten.strategies.expert_parallel import find_experts as find

    check_compile(plan, compile_plan is not None)
    return find(module, plan)


def apply_expert_parallel(experts: list[tuple[str, nn.Module]], plan: ExpertParallelPlan | None) -> None:
    """Expert parallelism: each experts module's weights split over ``ep`` and its forward
    dispatching tokens by all-to-all (``expert_parallel.apply_expert_parallel``)."""
    if plan is not None:
        from hasten.strategies.expert_parallel import apply_expert_parallel as apply

        apply(experts, plan)


def apply_activation_checkpointing(module: nn.Module, blocks: list[nn.Module], plan: CheckpointingPlan | None) -> None:
    """Recompute each block's activations in backward (each top-level child without blocks; one
    in ``every_nth_block``), or set compile's memory budget (a process-wide setting of torch's)."""
    if plan is None:
        return
    if plan.memory_budget is not None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = plan.memory_budget
    if plan.wrapper is None:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as apply

    chosen = {id(b) for b in (blocks or list(module.children()))[:: plan.every_nth_block]}
    apply(module, checkpoint_wrapper_fn=plan.wrapper, check_fn=lambda m: id(m) in chosen)
    _no_cache_when_training(module)


def _no_cache_when_training(module: nn.Module) -> None:
    """A transformers model (its ``config.use_cache`` true by default) fills a key/value cache in
    every forward, a training one too: under checkpointing each block's recomputation writes it
    again, so the recomputed attention sees twice the keys (selective checkpointing then fails:
    the recomputation's ops differ from the forward's) and the cache holds every layer's keys and
    values until the output goes. As transformers does under its own gradient checkpointing, a
    forward that records gradients in training mode runs with ``use_cache=False``."""
    import inspect

    if not getattr(getattr(module, "config", None), "use_cache", False):
        return
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return
    if "use_cache" not in names:
        return
    at = names.index("use_cache")

    def no_cache(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (mod.training and torch.is_grad_enabled()):
            return None
        if len(args) > at:  # given by position
            return (*args[:at], False, *args[at + 1 :]), kwargs
        kwargs["use_cache"] = False
        return args, kwargs

    module.register_forward_pre_hook(no_cache, with_kwargs=True)


def apply_placement(model: nn.Module, inner: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Where nothing is sharded: a model built on the meta device is allocated and initialised
    where FSDP would have (``plan.materialise``), else refused; the model is moved to the device."""
    if plan.sharding is not None:
        return model  # sharded on the mesh's device, whatever device_placement says
    if plan.materialise is not None:
        from hasten.strategies import materialise as mat

        found = mat.survey(inner, 1)
        if found.source == "init" or found.meta_buffers:
            m = plan.materialise
            mat.materialise_plain(inner, m.device if plan.device_placement else torch.device("cpu"))
            mat.fill(inner, found, {}, m.device, True, m.init_fn)
    meta = next((n for n, p in inner.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"prepare() got a model on the meta device ({meta} and maybe more): only FSDP "
            "(fsdp_plugin=FullyShardedDataParallelPlugin()) allocates and initialises such a model; "
            "otherwise build it for real, or load its weights first (load_state_dict(..., assign=True))"
        )
    return model.to(plan.device) if plan.device_placement else model


def apply_autocast(module: nn.Module, precision: Precision | None) -> None:
    """The precision's autocast forward on the user's module, inside any wrapper, so the module
    ``unwrap`` returns autocasts the same way on any number of processes (Accelerate's
    ``keep_fp32_wrapper=True``)."""
    if precision is not None:
        precision.wrap_forward(module)


def apply_compile(module: nn.Module, compiler: Compiler | None, blocks: list[nn.Module]) -> bool:
    """Compile in place, before wrapping: the repeated blocks (regional compilation), else each
    of ``blocks`` (FSDP's, torchtitan's order). False if nothing was compiled: the whole model
    is then compiled after wrapping."""
    if compiler is None:
        return False
    if compiler.regional:
        return compiler.compile_regions(module)
    for block in blocks:
        block.compile(**compiler.kwargs)
    return bool(blocks)


def apply_materialise(module: nn.Module, on_meta: OnMeta | None, plan: ParallelizePlan) -> None:
    """Where FSDP shards: only this process's shards are allocated, then filled from where
    ``survey`` said (each process's own copy, the main process's, or initialised); then every
    process waits for the others."""
    if plan.sharding is None:
        return
    import torch.distributed as dist

    if on_meta is not None:
        from hasten.strategies import materialise as mat

        m = plan.materialise
        mat.materialise(module, m.param_device, m.device)
        mat.fill(module, on_meta.survey, on_meta.values, m.device, m.is_main_process, m.init_fn)
    dist.barrier()


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module
