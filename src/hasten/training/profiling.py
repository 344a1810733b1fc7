"""Profiling: ``accelerator.profile()`` runs ``torch.profiler`` and writes one Chrome trace per rank.

Consumes ``ProfileKwargs`` (its ``build()`` makes the profiler). While the profiler is active,
the accelerator's prepared objects are labelled, so the trace shows what each span of time
was spent on:

================================  ==========================================================
``hasten.forward``                a prepared model's forward
``hasten.backward``               ``accelerator.backward(loss)`` (through ``Precision.around_backward``)
``hasten.optimizer_step``         a prepared optimizer's ``step()``
``hasten.data_wait``              waiting for the next batch of a prepared dataloader
================================  ==========================================================

The labels are installed when ``profile()`` is entered, on the objects prepared so far, and
removed when it exits: outside a profiled block the hot path is exactly what it was, with no
profiler checks at all. ``record_function(name)`` adds your own ranges.

While the schedule is idle (``skip_first`` and ``wait`` steps), ``prof.step()`` only counts
the step (see ``_QuietProfile``); the traces are the same as torch's.

Export: with ``output_trace_dir`` set, each completed active cycle of the profiler is written
when torch reports it ready (the moment ``on_trace_ready`` is called), as
``trace_rank{rank}.json`` without a schedule, or ``trace_rank{rank}_cycle{k}.json`` (k = 1, 2,
...) with one. A user ``on_trace_ready`` is still called, after the export, exactly as often
as torch calls it. Entering ``profile()`` removes this rank's traces of an earlier block from
that folder (and the main process those of ranks beyond this run's), so the folder holds one
run. On a normal exit every rank waits for the
others, so when ``profile()`` returns on the main process all traces are written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.profiler

from hasten.settings import environment as env
from hasten.settings.handlers import ProfileKwargs
from hasten.training.labels import BACKWARD, DATA_WAIT, FORWARD, OPTIMIZER_STEP, TRACE_RE, trace_file_name

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.training.precision import Precision
    from hasten.training.registry import PreparedObjects

__all__ = ["profile", "record_function", "trace_path", "FORWARD", "BACKWARD", "OPTIMIZER_STEP", "DATA_WAIT"]

_MISSING = object()
_END = object()
# Whether a profiler records on this thread now. A label is a record_function range, about
# 10 us to open and close even when nothing records; in the schedule's wait and warmup
# steps the labels skip it (the trace is the same: a range opened then records nothing).
_profiler_enabled = torch.autograd._profiler_enabled


def trace_path(directory: str, rank: int, cycle: int | None = None) -> str:
    """Where rank ``rank`` writes its trace (``cycle``: the k-th active cycle of a schedule)."""
    return os.path.join(directory, trace_file_name(rank, cycle))


def record_function(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace of an active profiler (a context manager or decorator)."""
    if not isinstance(name, str):
        raise TypeError(f"record_function name must be a str, got {name!r} ({type(name).__name__})")
    if not name.strip():
        raise ValueError(f"record_function name must be a non-empty string, got {name!r}")
    return torch.profiler.record_function(name)


# ---------------------------------------------------------------------- labels


def _labelled(label: str, function: Callable) -> Callable:
    @functools.wraps(function)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        if not _profiler_enabled():  # waiting or warming up: a range would record nothing
            return function(*args, **kwargs)
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    labelled._hasten_label = label  # type: ignore[attr-defined]
    return labelled


_PROFILED_CLASSES: dict[type, type] = {}


def _profiled_class(cls: type) -> type:
    """A subclass of a dataloader class whose iteration labels each wait for a batch."""
    if cls not in _PROFILED_CLASSES:
        base_iter = cls.__iter__

        def __iter__(self: Any) -> Iterator[Any]:
            batches = base_iter(self)
            try:
                while True:
                    if _profiler_enabled():
                        with torch.profiler.record_function(DATA_WAIT):
                            batch = next(batches, _END)
                    else:  # waiting or warming up: a range would record nothing
                        batch = next(batches, _END)
                    if batch is _END:
                        return
                    yield batch
            finally:  # a loop left early closes the inner iteration at once, as without profiling
                close = getattr(batches, "close", None)
                if close is not None:
                    close()

        _PROFILED_CLASSES[cls] = type(
            cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _PROFILED_CLASSES[cls]


class _Labels:
    """Installs the labels on the prepared objects of one Accelerator, and removes them again."""

    def __init__(
        self,
        prepared: PreparedObjects,
        precision: Precision,
        profiler: torch.profiler.profile,
        step_with_optimizer: bool,
    ) -> None:
        self.prepared = prepared
        self.precision = precision
        self.profiler = profiler
        self.step_with_optimizer = step_with_optimizer
        self.steps_seen = prepared.real_steps()
        # (object, attribute, value before, value installed)
        self.patched: list[tuple[Any, str, Any, Any]] = []
        self.classes: list[tuple[Any, type, type]] = []

    def _advance(self) -> None:
        """One profiler step per real optimizer step (of every prepared optimizer)."""
        count = self.prepared.real_steps()
        if count > self.steps_seen:
            self.steps_seen = count
            self.profiler.step()

    def _set(self, obj: Any, name: str, value: Callable) -> None:
        before = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)
        self.patched.append((obj, name, before, value))

    def install(self) -> None:
        for model in _unique(self.prepared.models):
            self._set(model, "forward", _labelled(FORWARD, model.forward))
        self.precision.around_backward = _backward_range
        for optimizer in _unique(self.prepared.optimizers):
            step = _labelled(OPTIMIZER_STEP, optimizer.step)
            if self.step_with_optimizer:
                step = self._stepping(step)
            self._set(optimizer, "step", step)
        for loader in _unique(self.prepared.dataloaders):
            cls = type(loader)
            profiled = _profiled_class(cls)
            loader.__class__ = profiled
            self.classes.append((loader, cls, profiled))

    def _stepping(self, step: Callable) -> Callable:
        @functools.wraps(step)
        def stepping(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self._advance()
            return out

        stepping._hasten_label = OPTIMIZER_STEP  # type: ignore[attr-defined]
        return stepping

    def remove(self) -> None:
        """Put back what was there, unless someone replaced our wrapper meanwhile."""
        if self.precision.around_backward is _backward_range:
            self.precision.around_backward = None
        for obj, name, before, installed in reversed(self.patched):
            if obj.__dict__.get(name, _MISSING) is not installed:
                continue
            if before is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        for loader, cls, profiled in self.classes:
            if type(loader) is profiled:
                loader.__class__ = cls
        self.patched.clear()
        self.classes.clear()


def _backward_range() -> contextlib.AbstractContextManager:
    """The backward label, entered by ``Precision.backward`` while a profiled block is active."""
    if not _profiler_enabled():  # waiting or warming up: a range would record nothing
        return contextlib.nullcontext()
    return torch.profiler.record_function(BACKWARD)


_backward_range._hasten_label = BACKWARD  # type: ignore[attr-defined]


def _unique(objects: list) -> list:
    seen: set[int] = set()
    return [o for o in objects if not (id(o) in seen or seen.add(id(o)))]


class _HasPrecision(Protocol):
    """What ``is_profiling`` reads of an Accelerator (so this module needs no import of it)."""

    precision: Precision


def is_profiling(accelerator: _HasPrecision) -> bool:
    """True while ``accelerator.profile()`` is active on this accelerator."""
    return accelerator.precision.around_backward is _backward_range


# ---------------------------------------------------------------------- the profiler

_NONE = torch.profiler.ProfilerAction.NONE


def first_busy_step(schedule_option: dict[str, int], step: int) -> int | None:
    """The first step >= ``step`` at which ``torch.profiler.schedule(**schedule_option)`` is not
    idle (NONE): where warmup or recording begins, or ``step`` itself if it is busy; None if the
    schedule never wakes again (its ``repeat`` cycles are over)."""
    skip_first = schedule_option.get("skip_first", 0)
    wait = schedule_option.get("wait", 0)
    period = wait + schedule_option.get("warmup", 0) + schedule_option["active"]
    repeat = schedule_option.get("repeat", 0)
    step = max(step, skip_first)
    offset = step - skip_first  # steps since the first cycle began
    if repeat and offset >= repeat * period:
        return None
    into_cycle = offset % period
    return step if into_cycle >= wait else step + (wait - into_cycle)


class _QuietProfile(torch.profiler.profile):
    """``torch.profiler.profile`` without its per-step work while the schedule waits.

    On every ``step()`` torch closes one ``ProfilerStep#N`` range and opens the next, and
    walks its schedule's state machine, even in ``skip_first`` and ``wait`` steps where no
    profiler records: tens of microseconds a step, several percent of a small model's step.
    While the current step and the next one are both idle, this only counts the step (one
    comparison): the ranges it leaves out would have recorded nothing, so the traces,
    ``step_num`` and the ``on_trace_ready`` calls are the same as torch's. Any other step is
    torch's own ``step()``.
    """

    _hasten_schedule: dict[str, int] | None = None  # None: never quiet (KINETO_USE_DAEMON counts steps)
    _quiet_until: float = 0  # while step_num + 1 is below this, step() only counts

    def _idle_until(self) -> float:
        """Where the quiet steps from here end: the first busy step after this one (or never)."""
        if self._hasten_schedule is None or self.current_action is not _NONE:
            return 0
        busy = first_busy_step(self._hasten_schedule, self.step_num + 1)
        return math.inf if busy is None else busy

    def start(self) -> None:
        self._quiet_until = self._idle_until()
        if self._quiet_until:
            return  # idle at entry: torch would only open a ProfilerStep#0 range that records nothing
        super().start()

    def step(self) -> None:
        if self.step_num + 1 < self._quiet_until:
            if self.step_rec_fn is not None:  # opened by torch on the step that ended the last cycle
                self.step_rec_fn.__exit__(None, None, None)
                self.step_rec_fn = None
            self.step_num += 1
            return
        super().step()
        self._quiet_until = self._idle_until()


def _quiet(profiler: torch.profiler.profile, schedule_option: dict[str, int] | None) -> torch.profiler.profile:
    """The profiler ``ProfileKwargs.build()`` made, as a ``_QuietProfile`` where it has a schedule."""
    if schedule_option and type(profiler) is torch.profiler.profile:
        profiler.__class__ = _QuietProfile
        if not env.get(env.KINETO_USE_DAEMON):
            profiler._hasten_schedule = dict(schedule_option)
    return profiler


# ---------------------------------------------------------------------- export


class _Exporter:
    """The ``on_trace_ready`` torch calls: export this cycle, then call the user's callback."""

    def __init__(self, directory: str, rank: int, scheduled: bool, user_callback: Callable | None) -> None:
        self.directory = directory
        self.rank = rank
        self.scheduled = scheduled
        self.user_callback = user_callback
        self.cycles = 0
        self.written: list[str] = []

    def __call__(self, prof: torch.profiler.profile) -> None:
        self.cycles += 1
        path = trace_path(self.directory, self.rank, self.cycles if self.scheduled else None)
        prof.export_chrome_trace(path)
        self.written.append(path)
        if self.user_callback is not None:
            self.user_callback(prof)


def _remove_old_traces(directory: str, rank: int, num_processes: int) -> None:
    """This rank's traces of an earlier run; the main process also drops ranks beyond this run's."""
    for name in os.listdir(directory):
        m = TRACE_RE.match(name)
        if m and (int(m.group(1)) == rank or (rank == 0 and int(m.group(1)) >= num_processes)):
            os.remove(os.path.join(directory, name))


@contextlib.contextmanager
def profile(
    handler: ProfileKwargs | None, prepared: PreparedObjects, precision: Precision, state: ProcessState
) -> Iterator[torch.profiler.profile]:
    """Run the block under ``torch.profiler`` with hasten's labels; export this rank's traces.

    Yields the ``torch.profiler.profile`` object (call ``prof.step()`` on it, unless
    ``step_with_optimizer=True`` steps it for you on each real optimizer step).
    """
    handler = handler if handler is not None else ProfileKwargs()
    if not isinstance(handler, ProfileKwargs):
        raise TypeError(f"profile_handler must be a ProfileKwargs, got {handler!r} ({type(handler).__name__})")
    if precision.around_backward is _backward_range:
        raise RuntimeError("accelerator.profile() is already active on this accelerator; profiled blocks cannot nest")
    step_with_optimizer = getattr(handler, "step_with_optimizer", False)
    if step_with_optimizer and not prepared.optimizers:
        raise ValueError(
            "ProfileKwargs.step_with_optimizer=True steps the profiler on each optimizer step, but no optimizer "
            "has been prepared: call accelerator.prepare(..., optimizer, ...) before accelerator.profile()"
        )
    rank = state.process_index
    exporter: _Exporter | None = None
    if handler.output_trace_dir is not None:
        try:  # ProfileKwargs checked the folder; this catches what changed on disk since
            os.makedirs(handler.output_trace_dir, exist_ok=True)
        except OSError as err:
            raise ValueError(
                f"ProfileKwargs.output_trace_dir {handler.output_trace_dir!r} cannot be created: "
                f"{err.strerror or err}; name a folder where each rank may write its Chrome trace"
            ) from None
        _remove_old_traces(handler.output_trace_dir, rank, state.num_processes)
        exporter = _Exporter(
            handler.output_trace_dir, rank, handler.schedule_option is not None, handler.on_trace_ready
        )
        profiler = _quiet(dataclasses.replace(handler, on_trace_ready=exporter).build(), handler.schedule_option)
    else:
        profiler = _quiet(handler.build(), handler.schedule_option)

    labels = _Labels(prepared, precision, profiler, step_with_optimizer)
    try:
        labels.install()
        with profiler:
            yield profiler
    finally:
        labels.remove()
    if exporter is not None and not exporter.written:
        warnings.warn(
            f"accelerator.profile(): rank {rank} completed no active profiling cycle "
            f"(schedule_option={handler.schedule_option}, {profiler.step_num} profiler steps), "
            f"so no trace was written to {handler.output_trace_dir!r}",
            stacklevel=3,
        )
    state.wait_for_everyone()
