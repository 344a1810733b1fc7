"""``hasten profile-report DIR``: read the per-rank traces of ``accelerator.profile()``.

It prints (1) the top operators by self time with their spread across ranks, and a per-step
time breakdown (forward / backward / optimizer / data, from hasten's labels), writes (2) one
merged Chrome trace in which each rank is its own process row (open it in
https://ui.perfetto.dev or chrome://tracing), and (3) a PNG chart of both (needs matplotlib:
``pip install 'hasten[report]'``; without it, (1) and (2) are still done).

This package reads JSON only: it does not import torch, so it runs anywhere the traces are.
Run it as ``hasten profile-report DIR`` or ``python -m hasten.report DIR``.

It refuses before it touches anything: every trace must be a regular file (not a folder, a
device such as ``/dev/zero`` or a pipe) of at most ``--max-trace-mb`` MB (default 1024), the
output files are created before the traces are read, each event is checked for the fields
the report reads (errors name the file, the event and the field), and traces of different
runs (world sizes that differ, cycles of one rank written by two processes, ranks recorded
more than a minute apart) are refused. Traces are read streaming, an event at a time with
``json``'s own decoder, twice (the report, then the merged trace, written an event at a
time): memory stays bounded whatever the traces' size (about 50 MB for a 189 MB trace).

Which file holds what (every name below is also importable from ``hasten.report`` itself):

- ``traces.py``: reading and checking: ``TraceError``, the streaming JSON reader,
  ``check_event``, ``TraceFile``, ``RankTrace`` (its ``OpStats``), ``find_trace_files``, ``load_traces``, the
  size limit (``DEFAULT_MAX_TRACE_MB``) and the one-run check (``RUN_GAP_S``).
- ``summary.py``: the numbers: ``StepBreakdown``, ``RankSummary``,
  ``self_times``, ``step_breakdown``, ``summarise``, ``analyse``, ``top_names``.
- ``tables.py``: the printed text: ``format_report`` and its tables.
- ``merge.py``: the merged trace: ``merge_traces``, ``write_merged_trace``.
- ``chart.py``: the PNG chart: ``write_chart`` (the only place matplotlib is imported, lazily).
- ``cli.py``: the command line: ``add_arguments``, ``run``, ``main``, the output files.
- ``__main__.py``: ``python -m hasten.report``.
"""

from __future__ import annotations

from hasten.report.chart import write_chart
from hasten.report.cli import DESCRIPTION, INSTALL_HINT, MERGED_NAME, PNG_NAME, add_arguments, main, run
from hasten.report.merge import merge_traces, write_merged_trace
from hasten.report.summary import (
    PHASE_NAMES,
    OpStats,
    RankSummary,
    StepBreakdown,
    analyse,
    self_times,
    step_breakdown,
    summarise,
    top_names,
)
from hasten.report.tables import format_report
from hasten.report.traces import (
    _CHUNK_CHARS,  # noqa: F401 - read by tests/test_profiling.py
    _PROCESS_META,  # noqa: F401 - read by tests/test_profiling.py
    DEFAULT_MAX_TRACE_MB,
    RUN_GAP_S,
    RankTrace,
    TraceError,
    TraceFile,
    check_event,
    find_trace_files,
    load_traces,
)
from hasten.training.labels import (
    BACKWARD,
    DATA_WAIT,
    FORWARD,
    OPTIMIZER_STEP,
    PHASES,
    STEP_PREFIX,
    TRACE_RE,
    trace_file_name,
)

__all__ = [
    "FORWARD",
    "BACKWARD",
    "OPTIMIZER_STEP",
    "DATA_WAIT",
    "TraceError",
    "RankTrace",
    "load_traces",
    "analyse",
    "format_report",
    "merge_traces",
    "write_merged_trace",
    "check_event",
    "DEFAULT_MAX_TRACE_MB",
    "write_chart",
    "add_arguments",
    "run",
    "main",
]
