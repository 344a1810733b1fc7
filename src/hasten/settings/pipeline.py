"""Pipeline parallelism's settings: :class:`TorchPipelineParallelConfig` and the checks of its numbers.

The schedules are torch's (``torch.distributed.pipelining.schedules.get_schedule_class``), by
torch's names; each field is checked at construction, and what depends on the run (the number
of stages, the processes on the ``pp`` dim, the batch size) is checked by :meth:`~TorchPipelineParallelConfig.stages`
and :func:`check_microbatches` with the rules torch 2.13's schedule constructors apply, so that a
bad number is refused before a process group or a stage is built. Importing this module does not
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hasten import _validate as v
from hasten.settings.handlers import KwargsHandler

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = [
    "PIPELINE_SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
    "TorchPipelineParallelConfig",
    "check_microbatches",
]

# torch's schedule names (``get_schedule_class`` takes them in any case; its two base classes,
# "PipelineScheduleSingle" and "PipelineScheduleMulti", are not schedules one can run).
PIPELINE_SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# One stage on each process (``PipelineScheduleSingle``); the others take several.
SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")
_MULTI = tuple(s for s in PIPELINE_SCHEDULES if s not in SINGLE_STAGE_SCHEDULES)
# Exactly two stages on each process, placed in a V: process r holds stages r and n-1-r.
V_SCHEDULES: tuple[str, ...] = ("ZBVZeroBubble", "DualPipeV")
# Those whose constructor refuses fewer microbatches than stages.
AT_LEAST_ONE_MICROBATCH_PER_STAGE: tuple[str, ...] = ("1F1B", "DualPipeV")
# Those whose constructor wants the microbatches a multiple of its rounds, max(1, m // pp_size).
ROUND_SCHEDULES: tuple[str, ...] = ("Interleaved1F1B", "InterleavedZeroBubble")

_OWNER = "TorchPipelineParallelConfig"


def _canonical_schedule(value: Any) -> str:
    """``value`` as torch spells it (torch matches names in any case), else a TypeError or a
    ValueError listing the schedules."""
    allowed = ", ".join(map(repr, PIPELINE_SCHEDULES))
    if not isinstance(value, str):
        raise TypeError(f"{_OWNER}.schedule must be one of {allowed}, got {v.shown(value)} ({type(value).__name__})")
    by_lower = {name.lower(): name for name in PIPELINE_SCHEDULES}
    if str(value).lower() not in by_lower:
        raise ValueError(f"{_OWNER}.schedule must be one of {allowed} (in any case), got {v.shown(value)}")
    return by_lower[str(value).lower()]


def _check_split_points(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{_OWNER}.split_points must be a list of module names (such as ['layers.4']) or None, "
            f"got {v.shown(value)} ({type(value).__name__})"
        )
    if not value:
        raise ValueError(f"{_OWNER}.split_points must name at least one module (None: an even split), got []")
    for point in value:
        if not isinstance(point, str) or not point or point != point.strip():
            raise ValueError(
                f"{_OWNER}.split_points must hold module names (non-empty text without spaces around it, "
                f"such as 'layers.4'), got {v.shown(point)} in {v.shown(value)}"
            )
    repeated = sorted({p for p in value if value.count(p) > 1})
    if repeated:
        raise ValueError(f"{_OWNER}.split_points names {', '.join(map(repr, repeated))} more than once: {value!r}")
    return list(value)


@dataclass
class TorchPipelineParallelConfig(KwargsHandler):
    """How pipeline parallelism (``ParallelismConfig.pp_size``) splits the model and runs it.

    ``schedule``: torch's schedule (``PIPELINE_SCHEDULES``). ``microbatches``: how many pieces
    each batch is cut into (None: the fewest the schedule allows that divide the batch, see
    :func:`check_microbatches`). ``split_points``: the names of the blocks where the stages after
    the first begin, such as ``["layers.4"]`` (torchtitan's ``pipeline_parallel_split_points``;
    None: an even split of the model's largest ModuleList of blocks). ``stages_per_rank``: the
    stages each process holds (None: 1 for GPipe and 1F1B, 2 for the others; the V schedules
    need exactly 2; with ``split_points`` it follows from them).
    """

    schedule: str = "1F1B"
    microbatches: int | None = None
    split_points: list[str] | None = None
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        self.schedule = _canonical_schedule(self.schedule)
        if self.microbatches is not None:
            v.check_number(_OWNER, "microbatches", self.microbatches, integer=True, ge=1)
        self.split_points = _check_split_points(self.split_points)
        if self.stages_per_rank is not None:
            v.check_number(_OWNER, "stages_per_rank", self.stages_per_rank, integer=True, ge=1)
            _check_stages_per_rank(self.schedule, self.stages_per_rank, "stages_per_rank")
            stages = None if self.split_points is None else len(self.split_points) + 1
            if stages is not None and stages % self.stages_per_rank:
                raise ValueError(
                    f"{_OWNER}.split_points makes {stages} stages, which is not a multiple of "
                    f"stages_per_rank={self.stages_per_rank}: give {self.stages_per_rank} stages to every process"
                )

    @property
    def single_stage(self) -> bool:
        """Whether the schedule runs one stage on each process (GPipe, 1F1B)."""
        return self.schedule in SINGLE_STAGE_SCHEDULES

    @property
    def style(self) -> str:
        """How stages are placed on the processes, in the words of torch's
        ``generate_stage_to_rank_mapping``: "v" for the V schedules, else "loop"."""
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def stages(self, pp_size: int) -> tuple[int, int]:
        """``(num_stages, stages_per_rank)`` on ``pp_size`` processes: from ``split_points``
        where given, else ``pp_size * stages_per_rank``; a ValueError where they disagree."""
        v.check_number("", "pp_size", pp_size, integer=True, ge=1)
        if self.split_points is None:
            per_rank = self.stages_per_rank or (1 if self.single_stage else 2)
            return pp_size * per_rank, per_rank
        num_stages = len(self.split_points) + 1
        if num_stages % pp_size:
            raise ValueError(
                f"{_OWNER}.split_points makes {num_stages} stages ({len(self.split_points)} split points), "
                f"which do not share out evenly over pp_size={pp_size} processes: give a multiple of {pp_size} stages"
            )
        per_rank = num_stages // pp_size
        if self.stages_per_rank is not None and per_rank != self.stages_per_rank:
            raise ValueError(
                f"{_OWNER}.split_points makes {num_stages} stages, {per_rank} on each of pp_size={pp_size} "
                f"processes, but stages_per_rank={self.stages_per_rank}"
            )
        _check_stages_per_rank(self.schedule, per_rank, f"split_points (with pp_size={pp_size})")
        return num_stages, per_rank

    def schedule_class(self) -> type[_PipelineSchedule]:
        """torch's schedule class (``get_schedule_class(self.schedule)``)."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        return get_schedule_class(self.schedule)


def _check_stages_per_rank(schedule: str, per_rank: int, what: str) -> None:
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ValueError(
            f"{_OWNER}.{what} gives {per_rank} stages to each process, but schedule={schedule!r} runs one "
            f"stage on each process: use 1, or a schedule with several ({', '.join(map(repr, _MULTI))})"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ValueError(
            f"{_OWNER}.{what} gives {per_rank} stages to each process, but schedule={schedule!r} needs "
            f"exactly 2 on each (placed in a V)"
        )


def _microbatch_problem(schedule: str, microbatches: int, num_stages: int, pp_size: int) -> str | None:
    """Why torch's ``schedule`` refuses ``microbatches`` (torch 2.13's constructors), or None."""
    if schedule in AT_LEAST_ONE_MICROBATCH_PER_STAGE and microbatches < num_stages:
        return f"schedule {schedule!r} needs at least as many microbatches as stages ({num_stages})"
    if schedule in ROUND_SCHEDULES:
        rounds = max(1, microbatches // pp_size)
        if microbatches % rounds:
            return (
                f"schedule {schedule!r} needs a multiple of its rounds, max(1, microbatches // pp_size) = "
                f"{rounds} with pp_size={pp_size} (such as {pp_size * rounds}; any multiple of {pp_size} is)"
            )
    return None


def check_microbatches(
    config: TorchPipelineParallelConfig, num_stages: int, batch_size: int, pp_size: int | None = None
) -> int:
    """The number of microbatches to cut a batch of ``batch_size`` into, checked against the rules of
    torch's schedules for ``num_stages`` stages over ``pp_size`` processes (None:
    ``num_stages // stages_per_rank``).

    1F1B and DualPipeV need at least as many microbatches as stages; Interleaved1F1B and
    InterleavedZeroBubble a multiple of their rounds, ``max(1, microbatches // pp_size)``; every
    schedule a batch that divides evenly (else the mean of the microbatches' mean losses is not
    the batch's mean). ``config.microbatches`` None: the fewest that meet these rules, at least
    ``num_stages``. A ValueError names the numbers.
    """
    v.check_number("", "num_stages", num_stages, integer=True, ge=1)
    v.check_number("", "batch_size", batch_size, integer=True, ge=1)
    if pp_size is None:
        per_rank = config.stages_per_rank or (1 if config.single_stage else 2)
        pp_size = max(1, num_stages // per_rank)
    v.check_number("", "pp_size", pp_size, integer=True, ge=1)
    if config.microbatches is None:
        for candidate in range(num_stages, batch_size + 1):
            fits = batch_size % candidate == 0
            if fits and _microbatch_problem(config.schedule, candidate, num_stages, pp_size) is None:
                return candidate
        raise ValueError(
            f"a batch of {batch_size} cannot be cut evenly into at least {num_stages} microbatches "
            f"(one per stage) that schedule {config.schedule!r} accepts: make each process's batch a multiple "
            f"of {num_stages}, or set {_OWNER}.microbatches"
        )
    microbatches = config.microbatches
    problem = _microbatch_problem(config.schedule, microbatches, num_stages, pp_size)
    if problem is not None:
        raise ValueError(f"{_OWNER}.microbatches={microbatches} is refused: {problem}")
    if batch_size % microbatches:
        raise ValueError(
            f"{_OWNER}.microbatches={microbatches} does not divide the batch size {batch_size} evenly "
            f"(the loss would be the mean of unequal microbatches' means, not the batch's mean): use a batch "
            f"size that is a multiple of {microbatches}, or a number of microbatches that divides {batch_size}"
        )
    return microbatches
