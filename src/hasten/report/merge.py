"""The merged trace: every rank's events in one Chrome trace, each rank its own process row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import IO, Any

from hasten.report.traces import _FLOW_PHASES, _PROCESS_META, DEFAULT_MAX_TRACE_MB, RankTrace, _is_number, _JsonStream


def _merged_rows(traces: list[RankTrace]) -> tuple[dict[tuple[int, Any], int], dict[tuple[int, Any], str]]:
    """The merged trace's process rows: (rank, original pid or "profiler") -> new pid, and its name."""
    pids: dict[tuple[int, Any], int] = {}
    names: dict[tuple[int, Any], str] = {}
    for trace in traces:
        labels = {pid: label for f in trace.files for pid, label in f.labels.items()}
        host = trace.files[0].host_pid
        for f in trace.files:
            for pid in f.rows:
                key = _row_key(trace.rank, pid, host)
                if key in pids:
                    continue
                pids[key] = len(pids) + 1
                if pid == host:
                    names[key] = f"rank {trace.rank}"
                elif key[1] == "profiler":
                    names[key] = f"rank {trace.rank} · profiler"
                else:
                    names[key] = f"rank {trace.rank} · {labels.get(pid) or f'pid {pid}'}"
    return pids, names


def _row_key(rank: int, pid: Any, host: Any) -> tuple[int, Any]:
    # Kineto's bookkeeping rows ("Spans", "Traces", ...) share one "profiler" row per rank.
    return (rank, pid if isinstance(pid, int) or pid == host else "profiler")


def _merged_events(traces: list[RankTrace], limit_bytes: int) -> Iterator[dict[str, Any]]:
    """Every event of the merged trace, the files read again one event at a time."""
    pids, names = _merged_rows(traces)
    for key, new_pid in pids.items():
        yield {"ph": "M", "name": "process_name", "pid": new_pid, "tid": 0, "args": {"name": names[key]}}
        yield {"ph": "M", "name": "process_sort_index", "pid": new_pid, "tid": 0, "args": {"sort_index": new_pid}}
    next_id = 0
    for trace in traces:
        host = trace.files[0].host_pid
        id_base = next_id
        for f in trace.files:
            shift = trace.shift_us.get(f.path, 0.0)
            for e in _events(f.path, limit_bytes):
                if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                    continue
                new = {**e, "pid": pids[_row_key(trace.rank, e.get("pid"), host)]}
                if shift and _is_number(e.get("ts")):
                    new["ts"] = e["ts"] + shift
                if e.get("ph") in _FLOW_PHASES and "id" in e:
                    if isinstance(e["id"], int):
                        new["id"] = e["id"] + id_base
                        next_id = max(next_id, new["id"] + 1)
                    else:
                        new["id"] = f"rank{trace.rank}:{e['id']}"
                yield new


def _events(path: str, limit_bytes: int) -> Iterator[dict[str, Any]]:
    """The events of a trace file already read once by load_traces (so known to be well formed)."""
    with open(path, "rb") as binary:
        stream = _JsonStream(path, binary, limit_bytes)
        for key in stream.members():
            if key == "traceEvents":
                yield from stream.items()
            else:
                stream.value()


def _merged_header(traces: list[RankTrace]) -> dict[str, Any]:
    return {
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "hasten profile-report",
            "ranks": [t.rank for t in traces],
            "sources": {str(t.rank): [os.path.basename(f.path) for f in t.files] for t in traces},
        },
    }


def merge_traces(traces: list[RankTrace], max_trace_mb: float = DEFAULT_MAX_TRACE_MB) -> dict[str, Any]:
    """One Chrome trace holding every rank: each (rank, original process) is its own process row.

    Held in memory whole; ``write_merged_trace`` writes the same trace one event at a time."""
    return {"traceEvents": list(_merged_events(traces, int(max_trace_mb * 1e6))), **_merged_header(traces)}


def write_merged_trace(traces: list[RankTrace], out: IO[str], max_trace_mb: float = DEFAULT_MAX_TRACE_MB) -> None:
    """Write the merged trace to ``out``, streaming: memory does not grow with the traces' size."""
    header = _merged_header(traces)
    out.write("{")
    for key, value in header.items():
        out.write(f"{json.dumps(key)}: {json.dumps(value)}, ")
    out.write('"traceEvents": [')
    for i, event in enumerate(_merged_events(traces, int(max_trace_mb * 1e6))):
        out.write((",\n" if i else "\n") + json.dumps(event))
    out.write("\n]}\n")
