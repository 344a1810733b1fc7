"""Pipeline parallelism's split: which blocks each stage runs, and each stage built from the model.

:func:`split_plan` decides, once, where each stage starts: at the given split points (the names
of blocks, such as ``"layers.4"``: torchtitan's ``pipeline_parallel_split_points``), else at an
even split of the model's largest ``ModuleList`` (or ``ModuleDict``) of blocks. The modules
registered before that container (the embeddings) belong to the first stage, those after it
(the final norm, the head) to the last. :func:`build_stage` then makes one stage by deleting
what the stage does not own, as torchtitan does (no tracing, so it works on models built on the
meta device): blocks of other stages leave the container, and the modules before and after the
blocks become ``None`` outside the first and the last stage.

Unlike torchtitan, a stage keeps the blocks' own numbers (``layers.4`` stays ``layers.4`` in
stage 1, see :class:`StageBlocks`), so a stage's ``state_dict()`` keys are the whole model's
names: the stages' state dicts together are the whole model's (:func:`stage_keys` says which
keys each holds), and checkpoints move between pipeline and no pipeline without renaming.

What the model's forward must do: run on a stage, that is, skip the parts that are ``None`` or
absent, as torchtitan's models do::

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:  # only this stage's blocks; a ModuleDict: self.layers.values()
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

A model whose forward just runs its children in order (``embed``, every block, ``norm``,
``head``) need not change: wrap each stage in :class:`SequentialStage`, which runs the children
it has, in order, under the same names.
"""

from __future__ import annotations

import copy as copy_module
import difflib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hasten import _validate as v

__all__ = [
    "SequentialStage",
    "SplitPlan",
    "StageBlocks",
    "StageSpec",
    "build_stage",
    "split_plan",
    "stage_indices",
    "stage_keys",
]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StageSpec:
    """One stage: what it owns, by the whole model's module names."""

    index: int
    #: the blocks it runs, such as ``("layers.4", "layers.5")``
    blocks: tuple[str, ...]
    #: every module it owns: the modules before the blocks (first stage), its blocks, the modules
    #: after them (last stage)
    modules: tuple[str, ...]
    is_first: bool
    is_last: bool


@dataclass(frozen=True)
class SplitPlan:
    """Where each stage starts, decided once by :func:`split_plan`."""

    #: the name of the ModuleList (or ModuleDict) of blocks, such as ``"layers"``
    container: str
    #: the modules registered before the container (on the first stage) and after it (on the last),
    #: at each level of the container's path: ``("tok_embeddings",)``, ``("norm", "output")``
    before: tuple[str, ...]
    after: tuple[str, ...]
    stages: tuple[StageSpec, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def split_points(self) -> tuple[str, ...]:
        """The blocks where the stages after the first start."""
        return tuple(stage.blocks[0] for stage in self.stages[1:])

    def units(self) -> tuple[str, ...]:
        """Every module some stage owns (the modules before, every block, the modules after)."""
        return self.before + tuple(b for stage in self.stages for b in stage.blocks) + self.after


# ---------------------------------------------------------------------------- split_plan
def split_plan(model: nn.Module, split_points: Sequence[str] | None, num_stages: int) -> SplitPlan:
    """Where each of ``num_stages`` stages starts: at ``split_points`` (block names, in order; as
    many as ``num_stages - 1``), else at an even split of the model's largest ModuleList (or
    ModuleDict) of blocks (as ``torch.tensor_split``: the first ``blocks % num_stages`` stages
    get one block more).

    Refused with a ValueError: a split point that names no module (close names suggested), or a
    module that is not a block; split points out of order, or at the first block; more stages
    than blocks; a parameter two stages would share (tied weights) or that no stage owns (a
    parameter of the model itself). Reads the model only; works on the meta device.
    """
    v.check_number("", "num_stages", num_stages, integer=True, ge=1)
    if isinstance(split_points, str):
        raise TypeError(f"split_points must be a list of block names or None, got the text {split_points!r}")
    if split_points is None:
        container = _largest_container(model)
        count = len(_block_keys(model.get_submodule(container)))
        if num_stages > count:
            raise ValueError(
                f"cannot split the model into {num_stages} pipeline stages: its {container!r} holds {count} blocks, "
                f"and each stage needs at least one block; use at most {count} stages"
            )
        starts = [i * (count // num_stages) + min(i, count % num_stages) for i in range(num_stages)]
    else:
        if len(split_points) != num_stages - 1:
            raise ValueError(
                f"{len(split_points)} split points {list(split_points)!r} make {len(split_points) + 1} "
                f"stages, but there are {num_stages}: give {num_stages - 1} split points, or None for an even split"
            )
        container, starts = _resolve_points(model, list(split_points))
    keys = _block_keys(model.get_submodule(container))
    before, after = _around(model, container)
    ends = starts[1:] + [len(keys)]
    stages = []
    for index, (start, end) in enumerate(zip(starts, ends)):
        blocks = tuple(f"{container}.{key}" for key in keys[start:end])
        first, last = index == 0, index == num_stages - 1
        modules = (before if first else ()) + blocks + (after if last else ())
        stages.append(StageSpec(index, blocks, modules, first, last))
    plan = SplitPlan(container, before, after, tuple(stages))
    _check_parameters(model, plan)
    return plan


def _block_keys(container: nn.Module) -> list[str]:
    return [key for key, block in container._modules.items() if block is not None]


def _largest_container(model: nn.Module) -> str:
    """The name of the model's ModuleList or ModuleDict with the most blocks (the first of equals)."""
    found = [(len(_block_keys(m)), name) for name, m in model.named_modules() if name and isinstance(m, _CONTAINERS)]
    found = [(count, name) for count, name in found if count]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList or ModuleDict of blocks to split into pipeline stages: "
            f"build its blocks in one (torchtitan's models use `self.layers`), or give split_points"
        )
    best = max(count for count, _ in found)
    return next(name for count, name in found if count == best)


def _around(model: nn.Module, container: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules registered before and after ``container`` at each level of its path (those
    after it: the innermost level's first)."""
    before: list[str] = []
    after: list[str] = []
    parent, prefix = model, ""
    for part in container.split("."):
        items = list(parent._modules.items())
        here = list(parent._modules).index(part)
        before += [prefix + name for name, child in items[:here] if child is not None]
        after = [prefix + name for name, child in items[here + 1 :] if child is not None] + after
        parent, prefix = parent._modules[part], f"{prefix}{part}."
    return tuple(before), tuple(after)


def _resolve_points(model: nn.Module, points: list[str]) -> tuple[str, list[int]]:
    """The container the split points name blocks of, and the position of each (checked)."""
    modules = dict(model.named_modules())
    parents = set()
    for point in points:
        if point not in modules:
            raise ValueError(_unknown_point(model, point, modules))
        parent = point.rpartition(".")[0]
        if "." not in point or not isinstance(modules.get(parent), _CONTAINERS):
            raise ValueError(
                f"split point {point!r} names a {type(modules[point]).__name__} that is not a block of a ModuleList "
                f"or ModuleDict; split points name blocks, such as {_examples(model)}"
            )
        parents.add(parent)
    if len(parents) > 1:
        raise ValueError(
            f"split points {points!r} name blocks of {len(parents)} containers "
            f"({', '.join(map(repr, sorted(parents)))}); they must all be blocks of one ModuleList or ModuleDict"
        )
    container = parents.pop()
    keys = _block_keys(modules[container])
    positions = [keys.index(point.rpartition(".")[2]) for point in points]
    if positions[0] == 0:
        raise ValueError(
            f"split point {points[0]!r} is the first block of {container!r}: the first stage would run no block; "
            f"split at a later block, such as '{container}.{keys[min(1, len(keys) - 1)]}'"
        )
    if positions != sorted(positions):
        ordered = [f"{container}.{keys[p]}" for p in sorted(positions)]
        raise ValueError(f"split points {points!r} are not in the blocks' order: give {ordered!r}")
    return container, [0, *positions]


def _unknown_point(model: nn.Module, point: str, modules: dict[str, nn.Module]) -> str:
    close = difflib.get_close_matches(point, [name for name in modules if name], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"split point {point!r} names no module of {type(model).__name__}{hint} (blocks: {_examples(model)})"


def _examples(model: nn.Module) -> str:
    try:
        container = _largest_container(model)
    except ValueError:
        return "none found"
    keys = _block_keys(model.get_submodule(container))
    return f"'{container}.{keys[0]}' to '{container}.{keys[-1]}'"


def _check_parameters(model: nn.Module, plan: SplitPlan) -> None:
    """Every parameter on exactly one stage: none shared by two stages, none outside every stage."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in plan.stages:
        for unit in stage.modules:
            for name, param in model.get_submodule(unit).named_parameters():
                first = owner.setdefault(id(param), (stage.index, f"{unit}.{name}"))
                if first[0] != stage.index:
                    raise ValueError(
                        f"parameter {first[1]!r} (stage {first[0]}) is the same tensor as {unit}.{name} "
                        f"(stage {stage.index}): pipeline stages cannot share a parameter (tied weights); "
                        f"untie them, or split so that both are on one stage"
                    )
    for name, param in model.named_parameters():
        if id(param) not in owner:
            raise ValueError(
                f"parameter {name!r} is in none of the blocks nor in a module before or after them, so every "
                f"pipeline stage would hold its own copy: move it into a submodule"
            )


# ---------------------------------------------------------------------------- build_stage
class StageBlocks(nn.ModuleList):
    """The blocks of one stage, under their numbers in the whole model (``layers.4`` stays
    ``layers.4``; torch's ``del layers[i]`` would renumber them). It iterates and counts like a
    ModuleList; an integer index is a block's number in the whole model (``stage.layers[4]``);
    its blocks are fixed (no append, insert or extend)."""

    def __init__(self, blocks: Iterable[tuple[str, nn.Module]] = ()) -> None:
        super().__init__()
        for key, block in blocks:
            self.add_module(key, block)

    __repr__ = nn.Module.__repr__

    def _key(self, idx: int) -> str:
        if str(idx) not in self._modules:
            raise IndexError(f"block {idx} is not on this pipeline stage, which holds blocks {list(self._modules)}")
        return str(idx)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return StageBlocks(list(self._modules.items())[idx])
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        setattr(self, self._key(idx), module)

    def __delitem__(self, idx: Any) -> None:
        keys = list(self._modules)[idx] if isinstance(idx, slice) else [self._key(idx)]
        for key in keys:
            del self._modules[key]

    def _fixed(self, *args: Any, **kwargs: Any) -> StageBlocks:
        raise TypeError(
            "a pipeline stage's blocks are fixed when it is built (see hasten.strategies.pipeline_parallel.split)"
        )

    append = extend = insert = _fixed  # type: ignore[assignment]


def build_stage(
    model: nn.Module, plan: SplitPlan, stage_index: int | Sequence[int], *, copy: bool = True, share: bool = False
) -> nn.Module:
    """Stage ``stage_index`` of ``plan`` (or the stages of a sequence of indices, together: what
    one process holds): the model less what the stage does not own.

    The blocks of other stages leave the container (a ModuleList becomes a :class:`StageBlocks`
    keeping the blocks' numbers; a ModuleDict loses the other keys); the modules before the
    blocks are set to None outside the first stage, those after them outside the last.
    ``copy``: build it from a deep copy that skips what the stage does not own (so the model is
    left whole and a stage's tensors are its own); else cut the model itself (its last use).
    ``share`` (with ``copy``): the copy shares the owned modules and every tensor with the model
    (only the model's own object and the container are new): a view of part of the model.
    """
    indices = (stage_index,) if isinstance(stage_index, int) else tuple(stage_index)
    if not indices:
        raise ValueError("build_stage needs at least one stage index")
    for index in indices:
        v.check_number("", "stage_index", index, integer=True, ge=0, le=plan.num_stages - 1)
    owned = {name for index in indices for name in plan.stages[index].modules}
    missing = [name for name in (plan.container, *plan.units()) if name in owned or name == plan.container]
    missing = [name for name in missing if not _has_module(model, name)]
    if missing:  # (another part may have been cut away already: a process's part, cut into its stages)
        raise ValueError(
            f"the split plan does not fit {type(model).__name__}: it has no module {missing[0]!r} "
            f"(make the plan with split_plan(model, ...) from this model)"
        )
    dropped = [name for name in plan.units() if name not in owned and _has_module(model, name)]
    if copy:
        memo: dict[int, Any] = {id(model.get_submodule(name)): None for name in dropped}
        if share:
            memo.update({id(model.get_submodule(name)): model.get_submodule(name) for name in owned})
            memo.update({id(t): t for t in (*model.parameters(), *model.buffers())})
        stage = copy_module.deepcopy(model, memo)
    else:
        stage = model
    blocks = {b for index in indices for b in plan.stages[index].blocks}
    for name in dropped:
        parent, _, attr = name.rpartition(".")
        if parent != plan.container:
            setattr(stage.get_submodule(parent), attr, None)
    container = stage.get_submodule(plan.container)
    kept = [(key, block) for key, block in container._modules.items() if f"{plan.container}.{key}" in blocks]
    if isinstance(container, nn.ModuleDict):
        for key in [key for key in container._modules if f"{plan.container}.{key}" not in blocks]:
            del container[key]
    else:
        parent, _, attr = plan.container.rpartition(".")
        setattr(stage.get_submodule(parent), attr, StageBlocks(kept))
    return stage


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def stage_keys(model: nn.Module, plan: SplitPlan, stage_index: int) -> tuple[str, ...]:
    """The keys of the whole model's ``state_dict()`` that stage ``stage_index`` holds, in order:
    those of the modules it owns, and those of no stage's module (buffers of the model itself,
    which every stage keeps). A stage from :func:`build_stage` has exactly these keys."""
    owned = set(plan.stages[stage_index].modules)
    units = set(plan.units())

    def holds(key: str) -> bool:
        parts = key.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix in units:
                return prefix in owned
        return True

    return tuple(key for key in model.state_dict(keep_vars=True) if holds(key))


def stage_indices(style: str, num_stages: int, pp_size: int, pp_rank: int) -> tuple[int, ...]:
    """The stages process ``pp_rank`` of ``pp_size`` holds, in order: style "loop" (rank r holds
    r, r + pp_size, ...) or "v" (rank r holds r and num_stages - 1 - r), as torch's schedules
    place them (``TorchPipelineParallelConfig.style`` gives the style)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    if num_stages % pp_size:
        raise ValueError(f"{num_stages} pipeline stages do not share out evenly over {pp_size} processes")
    mapping = generate_stage_to_rank_mapping(pp_size, num_stages, style=style)
    return tuple(stage for stage, rank in sorted(mapping.items()) if rank == pp_rank)


# ---------------------------------------------------------------------------- SequentialStage
class SequentialStage(nn.Module):
    """A stage of a model whose forward runs its children in order (``embed``, every block of
    its ModuleList or ModuleDict, ``norm``, ``head``), for models whose own forward does not skip
    the parts a stage lacks. It holds the stage's children under the same names (so its
    ``state_dict()`` keys are the whole model's), and runs those it has, in order; a model with
    parameters or buffers of its own (its forward uses them) is refused."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        own = [name for name, _ in stage.named_parameters(recurse=False)]
        own += [name for name, _ in stage.named_buffers(recurse=False)]
        if own:
            raise ValueError(
                f"SequentialStage runs only the children of {type(stage).__name__}, but it has parameters or "
                f"buffers of its own ({', '.join(map(repr, own))}) that its forward uses: give the model a forward "
                f"that skips the parts a stage lacks (see hasten.strategies.pipeline_parallel.split)"
            )
        for name, child in stage._modules.items():
            if child is not None:
                self.add_module(name, child)

    def _steps(self) -> Iterator[nn.Module]:
        for child in self._modules.values():
            if isinstance(child, nn.ModuleDict):
                yield from child.values()
            elif isinstance(child, nn.ModuleList):
                yield from child
            elif child is not None:
                yield child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self._steps():
            x = step(x)
        return x
