"""Names shared by the runtime profiler (profiling.py) and the offline report (report/).

The ranges ``accelerator.profile()`` puts around the training step, and the names of the
per-rank trace files it writes. Pure Python, no imports of ours: the runtime imports this
module, never the report.
"""

from __future__ import annotations

import re

__all__ = [
    "FORWARD",
    "BACKWARD",
    "OPTIMIZER_STEP",
    "DATA_WAIT",
    "PHASES",
    "STEP_PREFIX",
    "TRACE_RE",
    "trace_file_name",
]

FORWARD = "hasten.forward"
BACKWARD = "hasten.backward"
OPTIMIZER_STEP = "hasten.optimizer_step"
DATA_WAIT = "hasten.data_wait"
# (phase shown by the report, label) in the order of a step.
PHASES: tuple[tuple[str, str], ...] = (
    ("forward", FORWARD),
    ("backward", BACKWARD),
    ("optimizer", OPTIMIZER_STEP),
    ("data", DATA_WAIT),
)
# torch.profiler's range around each prof.step() interval.
STEP_PREFIX = "ProfilerStep#"

TRACE_RE = re.compile(r"^trace_rank(\d+)(?:_cycle(\d+))?\.json$")


def trace_file_name(rank: int, cycle: int | None = None) -> str:
    """``trace_rank{rank}.json``, or ``trace_rank{rank}_cycle{cycle}.json`` with a schedule."""
    return f"trace_rank{rank}.json" if cycle is None else f"trace_rank{rank}_cycle{cycle}.json"
