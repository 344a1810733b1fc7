"""Working with the other processes: run-on decorators, a trigger any rank can raise, uneven
inputs under DDP (``torch.distributed.algorithms.Join``), and splitting inputs by rank.

As in Accelerate, a run-on decorator runs its function everywhere when there is only one
process, and returns None on the processes it skips.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from hasten import _validate as v
from hasten.distributed import ops


class _Processes(Protocol):
    """What these helpers read of ``hasten.compat.state.PartialState`` (which calls them with itself):
    a structural type, so that this module, below ``state``, needs no import of it."""

    use_distributed: bool
    process_index: int
    local_process_index: int

    def wait_for_everyone(self) -> None: ...


def run_on(function: Callable, runs_here: bool) -> Callable:
    """``function`` where ``runs_here``, else a function of the same signature that returns None."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if runs_here else None

    return wrapper


def on_process(
    state: _Processes, function: Callable | None, index: int | None, field: str, local: bool = False
) -> Callable:
    """The decorator of ``on_process``/``on_local_process``, usable with or without ``function``."""
    if index is None:
        raise TypeError(f"{field} is required: the index of the process that runs the function")
    v.check_number(f"on_{'local_' if local else ''}process", field, index, integer=True, ge=0)
    mine = state.local_process_index if local else state.process_index
    runs_here = mine == index or not state.use_distributed
    if function is None:
        return lambda fn: run_on(fn, runs_here)
    return run_on(function, runs_here)


class Trigger:
    """A flag any process can raise (``set``); ``check`` is a collective that every process calls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flag = torch.zeros((), dtype=torch.int64, device=device)

    def set(self) -> None:
        self.flag = torch.ones((), dtype=torch.int64, device=self.device)

    def check(self) -> bool:
        """True on every process if any raised the flag since the last check; the flag is then lowered."""
        raised = int(ops.reduce(self.flag, "sum").item()) >= 1
        if raised:
            self.flag = torch.zeros((), dtype=torch.int64, device=self.device)
        return raised


@contextlib.contextmanager
def join_uneven_inputs(
    state: _Processes, dataloaders: list[Any], joinables: list[Any], even_batches: bool | None, default: bool
) -> Iterator[None]:
    """``Join(joinables)`` while the prepared map-style dataloaders use ``even_batches`` (then restored).

    With even batches every process has as many batches and Join stays off; without them, a
    process that runs out of batches shadows the others' collectives until all are done.
    """
    v.check_optional_bool("join_uneven_inputs", "even_batches", even_batches)
    if not state.use_distributed:
        yield
        return
    from torch.distributed.algorithms import Join

    saved: list[tuple[Any, bool]] = []
    if even_batches is not None:
        for loader in dataloaders:
            if getattr(loader, "_main_process_reads", False):  # a DataLoaderDispatcher
                continue  # every process gets as many batches from the main process anyway
            sampler = getattr(loader, "shard_sampler", None)
            if sampler is None:
                warnings.warn(
                    "join_uneven_inputs(even_batches=...) changes map-style dataloaders only; "
                    "an iterable-dataset loader keeps its own setting",
                    stacklevel=4,
                )
                continue
            saved.append((sampler, sampler.even_batches))
            sampler.even_batches = even_batches
    try:
        with Join(
            joinables, enable=not (default if even_batches is None else even_batches), throw_on_early_termination=False
        ):
            yield
    finally:
        for sampler, value in saved:
            sampler.even_batches = value


def goes_first(state: _Processes, first: bool) -> Iterator[None]:
    """The body of ``main_process_first``: the ``first`` process runs the block before the others."""
    if not first:
        state.wait_for_everyone()
    yield
    if first:
        state.wait_for_everyone()


def split_between_processes(inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False) -> Any:
    """This process's contiguous share of a list, tuple, tensor or dict of them."""
    if isinstance(inputs, dict):
        return {k: split_between_processes(x, num_processes, process_index, apply_padding) for k, x in inputs.items()}
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(f"split_between_processes takes a list, tuple, tensor or dict, got {type(inputs).__name__}")
    n = len(inputs)
    per, extra = divmod(n, num_processes)
    start = process_index * per + min(process_index, extra)
    end = start + per + (1 if process_index < extra else 0)
    part = inputs[start:end]
    if apply_padding and extra and process_index >= extra and n:
        last = inputs[-1:]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part
