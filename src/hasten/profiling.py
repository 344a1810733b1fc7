"""Profiling: ``accelerator.profile()`` builds the profiler from ``ProfileKwargs`` and writes
one Chrome trace per rank. Consumes ``ProfileKwargs``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .handlers import ProfileKwargs
from .state import PartialState

TRACE_NAME = "trace_rank{rank}.json"


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, TRACE_NAME.format(rank=rank))


@contextlib.contextmanager
def profile(handler: ProfileKwargs | None, state: PartialState) -> Iterator[torch.profiler.profile]:
    """Run the block under ``torch.profiler``; export this rank's trace if a directory is set."""
    handler = handler or ProfileKwargs()
    if not isinstance(handler, ProfileKwargs):
        raise TypeError(f"profile_handler must be a ProfileKwargs, got {handler!r}")
    profiler = handler.build()
    with profiler:
        yield profiler
    if handler.output_trace_dir is not None:
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(trace_path(handler.output_trace_dir, state.process_index))
    state.wait_for_everyone()
