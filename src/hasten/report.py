"""``hasten profile-report DIR``: read the per-rank traces of ``accelerator.profile()``.

It prints (1) the top operators by self time with their spread across ranks, and a per-step
time breakdown (forward / backward / optimizer / data, from hasten's labels), writes (2) one
merged Chrome trace in which each rank is its own process row (open it in
https://ui.perfetto.dev or chrome://tracing), and (3) a PNG chart of both (needs matplotlib:
``pip install 'hasten[report]'``; without it, (1) and (2) are still done).

This module reads JSON only: it does not import torch, so it runs anywhere the traces are.
Run it as ``hasten profile-report DIR`` or ``python -m hasten.report DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .labels import BACKWARD, DATA_WAIT, FORWARD, OPTIMIZER_STEP, PHASES, STEP_PREFIX, TRACE_RE, trace_file_name

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
    "write_chart",
    "add_arguments",
    "run",
    "main",
]

PHASE_NAMES = tuple(p for p, _ in PHASES) + ("other",)
# Ranges torch itself records (dataloader iteration, optimizer methods): not the user's own.
_TORCH_RANGES = ("enumerate(DataLoader)", "Optimizer.", "DistributedDataParallel.", "gloo:", "nccl:", "## ")

MERGED_NAME = "merged_trace.json"
PNG_NAME = "profile_report.png"
INSTALL_HINT = "pip install 'hasten[report]'  (or: pip install matplotlib)"
DESCRIPTION = (
    "Summarise the per-rank traces written by accelerator.profile(): top operators by self time with "
    "their spread across ranks, a per-step breakdown (forward / backward / optimizer / data), one merged "
    "trace for Perfetto or chrome://tracing, and a PNG chart."
)

_HOST_CATS = ("cpu_op",)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class TraceError(ValueError):
    """A trace file that is missing, unreadable or not a Chrome trace (the message names it)."""


# ---------------------------------------------------------------------- reading


@dataclass
class TraceFile:
    path: str
    rank: int
    cycle: int | None
    data: dict[str, Any]

    @property
    def base_ns(self) -> int:
        base = self.data.get("baseTimeNanoseconds", 0)
        return int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0


@dataclass
class RankTrace:
    """All the events one rank wrote, with timestamps on a clock common to every rank."""

    rank: int
    files: list[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    world_size: int | None = None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not a text (JSON) file") from None
    if not text.strip():
        raise TraceError(f"trace {path} is empty (was the process stopped while writing it?)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(
            f"trace {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            "is it truncated or not a trace?"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(
            f"trace {path} is not a Chrome trace: expected a JSON object with a 'traceEvents' list "
            "(as written by accelerator.profile() or torch.profiler's export_chrome_trace)"
        )
    for i, event in enumerate(data["traceEvents"]):
        if not isinstance(event, dict):
            raise TraceError(f"trace {path}: traceEvents[{i}] is {event!r:.60}, not an event object")
        if event.get("ph") == "X" and not (_is_number(event.get("ts")) and _is_number(event.get("dur"))):
            raise TraceError(
                f"trace {path}: traceEvents[{i}] ({event.get('name')!r:.60}) is a complete event "
                "without numeric 'ts' and 'dur'"
            )
    return data


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def find_trace_files(directory: str) -> list[tuple[str, int, int | None]]:
    """(path, rank, cycle) of every per-rank trace in ``directory``, by rank then cycle."""
    if not os.path.exists(directory):
        raise TraceError(f"trace folder {directory} does not exist")
    if not os.path.isdir(directory):
        raise TraceError(f"{directory} is not a folder: give the output_trace_dir that holds trace_rank*.json")
    found = []
    for name in os.listdir(directory):
        m = TRACE_RE.match(name)
        if m:
            found.append((os.path.join(directory, name), int(m.group(1)), int(m.group(2)) if m.group(2) else None))
    if not found:
        raise TraceError(
            f"no traces in {directory}: expected trace_rank<N>.json files, written by accelerator.profile() "
            "with ProfileKwargs(output_trace_dir=...)"
        )
    found.sort(key=lambda t: (t[1], t[2] or 0))
    return found


def load_traces(directory: str) -> list[RankTrace]:
    """Read every rank's traces in ``directory``; errors name the file at fault."""
    files = [TraceFile(p, r, c, _read_json(p)) for p, r, c in find_trace_files(directory)]
    by_rank: dict[int, list[TraceFile]] = defaultdict(list)
    for f in files:
        by_rank[f.rank].append(f)
    for rank, group in by_rank.items():
        plain = [f for f in group if f.cycle is None]
        if plain and len(group) > 1:
            other = next(f for f in group if f.cycle is not None)
            raise TraceError(
                f"rank {rank} has both {plain[0].path} and {other.path}: traces of two different runs are mixed "
                "in one folder; keep one run's files"
            )
    world_sizes = {
        f.data["distributedInfo"].get("world_size")
        for f in files
        if isinstance(f.data.get("distributedInfo"), dict)
    } - {None}
    expected = max([max(by_rank) + 1, *[w for w in world_sizes if isinstance(w, int)]])
    for rank in range(expected):
        if rank not in by_rank:
            raise TraceError(
                f"missing trace for rank {rank}: {os.path.join(directory, trace_file_name(rank))} "
                f"(or its _cycle<k> files) not found, but the traces show {expected} ranks"
            )
    base = min(f.base_ns for f in files)
    traces = []
    for rank in sorted(by_rank):
        trace = RankTrace(rank, [f.path for f in by_rank[rank]], world_size=expected)
        for f in by_rank[rank]:
            shift = (f.base_ns - base) / 1000.0  # µs
            for event in f.data["traceEvents"]:
                if shift and _is_number(event.get("ts")):
                    event = {**event, "ts": event["ts"] + shift}
                trace.events.append(event)
        traces.append(trace)
    return traces


# ---------------------------------------------------------------------- analysis


@dataclass
class OpStats:
    calls: int = 0
    self_us: float = 0.0
    total_us: float = 0.0


@dataclass
class StepBreakdown:
    """Mean time per training step on one rank, in µs, split by hasten's labels."""

    steps: int
    step_us: float
    phases_us: dict[str, float]  # forward, backward, optimizer, data, other
    from_profiler_steps: bool


@dataclass
class RankSummary:
    rank: int
    ops: dict[str, OpStats]
    device_ops: dict[str, OpStats]
    user_ranges: dict[str, OpStats]
    breakdown: StepBreakdown | None


def _complete(events: Iterable[dict[str, Any]], cats: Sequence[str]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]


def self_times(events: Iterable[dict[str, Any]], cats: Sequence[str] = _HOST_CATS) -> dict[str, OpStats]:
    """Calls, self and total time of each operator name (self = time not spent in nested operators)."""
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in _complete(events, cats):
        threads[(e.get("pid"), e.get("tid"))].append(e)
    stats: dict[str, OpStats] = defaultdict(OpStats)

    def finish(frame: list) -> None:
        _, name, dur, children = frame
        s = stats[name]
        s.calls += 1
        s.total_us += dur
        s.self_us += max(0.0, dur - children)

    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, dur, time in direct children]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]:
                finish(stack.pop())
            if stack:
                stack[-1][3] += e["dur"]
            stack.append([e["ts"] + e["dur"], str(e.get("name", "?")), float(e["dur"]), 0.0])
        while stack:
            finish(stack.pop())
    return dict(stats)


def _outermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events not nested inside another event of the list (so nested labels count once)."""
    out: list[dict[str, Any]] = []
    end = -math.inf
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
        else:
            end = max(end, e["ts"] + e["dur"])
    return out


def step_breakdown(events: list[dict[str, Any]]) -> StepBreakdown | None:
    """Mean time per step, split into forward / backward / optimizer / data / other.

    Steps are torch's ``ProfilerStep#N`` ranges (``prof.step()`` or ``step_with_optimizer``);
    without them, the span of hasten's labels divided by the number of optimizer steps.
    """
    annotations = _complete(events, ("user_annotation",))
    labels = {phase: _outermost([e for e in annotations if e.get("name") == name]) for phase, name in PHASES}
    if not any(labels.values()):
        return None
    steps = sorted(
        (e for e in annotations if str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"]
    )
    if steps:
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
        from_steps = True
    else:
        labelled = [e for evs in labels.values() for e in evs]
        start = min(e["ts"] for e in labelled)
        end = max(e["ts"] + e["dur"] for e in labelled)
        windows = [(start, end)]
        from_steps = False
    totals = dict.fromkeys(PHASE_NAMES, 0.0)
    span = 0.0
    for start, end in windows:
        span += end - start
        for phase, evs in labels.items():
            totals[phase] += sum(e["dur"] for e in evs if start <= e["ts"] < end)
    count = len(windows) if from_steps else max(1, len(labels["optimizer"]) or len(labels["forward"]))
    step_us = span / count
    phases = {p: totals[p] / count for p in PHASE_NAMES if p != "other"}
    phases["other"] = max(0.0, step_us - sum(phases.values()))
    return StepBreakdown(count, step_us, phases, from_steps)


def summarise(trace: RankTrace) -> RankSummary:
    annotations = _complete(trace.events, ("user_annotation",))
    ours = {name for _, name in PHASES}
    user = [
        e
        for e in annotations
        if e.get("name") not in ours and not str(e.get("name", "")).startswith((STEP_PREFIX, *_TORCH_RANGES))
    ]
    user_ranges: dict[str, OpStats] = defaultdict(OpStats)
    for e in user:
        s = user_ranges[str(e.get("name"))]
        s.calls += 1
        s.total_us += e["dur"]
        s.self_us += e["dur"]
    return RankSummary(
        trace.rank,
        self_times(trace.events, _HOST_CATS),
        self_times(trace.events, _DEVICE_CATS),
        dict(user_ranges),
        step_breakdown(trace.events),
    )


def analyse(traces: list[RankTrace]) -> list[RankSummary]:
    return [summarise(t) for t in traces]


def top_names(per_rank: list[dict[str, OpStats]], n: int) -> list[str]:
    """The ``n`` names with the largest mean self time across ranks."""
    names = {name for ops in per_rank for name in ops}
    mean = {name: sum(ops[name].self_us for ops in per_rank if name in ops) / len(per_rank) for name in names}
    return sorted(names, key=lambda k: (-mean[k], k))[:n]


# ---------------------------------------------------------------------- the printed report


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _spread(values: list[float]) -> tuple[float, int]:
    """(max - min) / mean, and the index of the largest value."""
    mean = sum(values) / len(values)
    worst = max(range(len(values)), key=lambda i: values[i])
    return ((max(values) - min(values)) / mean if mean > 0 else 0.0), worst


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [(str.ljust if i < left else str.rjust) for i in range(len(header))]
    return ["  ".join(fmt[i](c, widths[i]) for i, c in enumerate(r)).rstrip() for r in [header, *rows]]


def _cut(name: str, width: int = 48) -> str:
    """A display name: autograd's long prefix shortened, then cut to ``width`` characters."""
    if name.startswith(_AUTOGRAD_PREFIX):
        name = "autograd: " + name[len(_AUTOGRAD_PREFIX) :]
    return name if len(name) <= width else name[: width - 1] + "…"


_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "


def _ops_table(
    summaries: list[RankSummary], per_rank: list[dict[str, OpStats]], n: int, what: str = "operator"
) -> list[str]:
    ranks = [s.rank for s in summaries]
    wide = len(ranks) <= 6
    header = [what, "calls"]
    header += [f"rank {r}" for r in ranks] if wide else ["min", "mean", "max"]
    if len(ranks) > 1:
        header += ["spread", "most"]
    rows = []
    for name in top_names(per_rank, n):
        values = [ops[name].self_us if name in ops else 0.0 for ops in per_rank]
        calls = max(ops[name].calls if name in ops else 0 for ops in per_rank)
        row = [_cut(name), str(calls)]
        row += [_ms(x) for x in values] if wide else [_ms(min(values)), _ms(sum(values) / len(values)), _ms(max(values))]
        if len(ranks) > 1:
            spread, worst = _spread(values)
            row += [f"{spread:.0%}", f"rank {ranks[worst]}"]
        rows.append(row)
    return _table(header, rows)


def format_report(summaries: list[RankSummary], top: int = 10) -> str:
    """The text report: step breakdown per rank, top operators with their spread across ranks."""
    out: list[str] = []
    ranks = [s.rank for s in summaries]
    out.append(f"hasten profile report: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}")
    out.append("")

    breakdowns = [s.breakdown for s in summaries]
    if all(b is None for b in breakdowns):
        out.append("Per-step breakdown: no hasten labels in these traces (profile with accelerator.profile() to get")
        out.append("forward / backward / optimizer / data ranges).")
    else:
        known = [b for b in breakdowns if b is not None]
        how = (
            "ProfilerStep ranges"
            if all(b.from_profiler_steps for b in known)
            else "optimizer steps (no ProfilerStep ranges: call prof.step() or set step_with_optimizer=True)"
        )
        out.append(f"Per-step time breakdown (ms per step, mean over the profiled steps; steps from {how})")
        header = ["rank", "steps", "step", *PHASE_NAMES]
        rows = []
        for s in summaries:
            b = s.breakdown
            if b is None:
                rows.append([str(s.rank), "0", "-", *["-"] * len(PHASE_NAMES)])
                continue
            cells = [f"{_ms(b.phases_us[p])} ({b.phases_us[p] / b.step_us:.0%})" if b.step_us else "0" for p in PHASE_NAMES]
            rows.append([str(s.rank), str(b.steps), _ms(b.step_us), *cells])
        out.extend(_table(header, rows, left=0))
        with_b = [s for s in summaries if s.breakdown is not None]
        if len(with_b) > 1:
            steps = [s.breakdown.step_us for s in with_b]  # type: ignore[union-attr]
            spread, worst = _spread(steps)
            fastest = min(range(len(steps)), key=lambda i: steps[i])
            out.append(
                f"slowest step: rank {with_b[worst].rank} ({_ms(steps[worst])} ms, "
                f"{spread:.0%} spread; fastest rank {with_b[fastest].rank} at {_ms(steps[fastest])} ms)"
            )
            gaps = []
            for p in PHASE_NAMES:
                vals = [s.breakdown.phases_us[p] for s in with_b]  # type: ignore[union-attr]
                hi = max(range(len(vals)), key=lambda i: vals[i])
                gaps.append((vals[hi] - min(vals), p, with_b[hi].rank))
            gap, phase, rank = max(gaps)
            if gap > 0:
                out.append(
                    f"largest gap between ranks: {phase}, rank {rank} spends {_ms(gap)} ms per step more than the "
                    "least busy rank (under DDP the faster ranks wait for the slowest inside backward)"
                )
    out.append("")

    host = [s.ops for s in summaries]
    if any(host):
        out.append(f"Top {top} operators by self CPU time (ms, summed over the profiled steps)")
        out.extend(_ops_table(summaries, host, top))
    else:
        out.append("No CPU operators recorded.")
    device = [s.device_ops for s in summaries]
    if any(device):
        out.append("")
        out.append(f"Top {top} device kernels by time (ms, summed over the profiled steps)")
        out.extend(_ops_table(summaries, device, top, "kernel"))
    user = [s.user_ranges for s in summaries]
    if any(user):
        out.append("")
        out.append("Your record_function ranges (ms, total)")
        out.extend(_ops_table(summaries, user, top, "range"))
    if len(ranks) > 1:
        out.append("")
        out.append("spread = (max - min) / mean across ranks; most = the rank that spent the most time there.")
        out.append("In a collective (c10d::*, gloo:*, nccl:*) the rank with the most time is usually the one")
        out.append("waiting for the others: the straggler is the rank that is late elsewhere.")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- merged trace

_PROCESS_META = ("process_name", "process_labels", "process_sort_index")


def merge_traces(traces: list[RankTrace]) -> dict[str, Any]:
    """One Chrome trace holding every rank: each (rank, original process) is its own process row."""
    merged: list[dict[str, Any]] = []
    pids: dict[tuple[int, Any], int] = {}
    names: dict[tuple[int, Any], str] = {}
    next_id = 0
    for trace in traces:
        labels: dict[Any, str] = {}
        for e in trace.events:
            if e.get("ph") == "M" and e.get("name") == "process_labels":
                labels[e.get("pid")] = str((e.get("args") or {}).get("labels", ""))
        host = _host_pid(trace.events, labels)
        id_base = next_id
        for e in trace.events:
            pid = e.get("pid")
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                continue
            # Kineto's bookkeeping rows ("Spans", "Traces", ...) share one "profiler" row per rank.
            key = (trace.rank, pid if isinstance(pid, int) or pid == host else "profiler")
            if key not in pids:
                pids[key] = len(pids) + 1
                if pid == host:
                    names[key] = f"rank {trace.rank}"
                elif key[1] == "profiler":
                    names[key] = f"rank {trace.rank} · profiler"
                else:
                    names[key] = f"rank {trace.rank} · {labels.get(pid) or f'pid {pid}'}"
            new = {**e, "pid": pids[key]}
            if e.get("ph") in ("s", "t", "f") and "id" in e:
                if isinstance(e["id"], int):
                    new["id"] = e["id"] + id_base
                    next_id = max(next_id, new["id"] + 1)
                else:
                    new["id"] = f"rank{trace.rank}:{e['id']}"
            merged.append(new)
    meta = []
    for key, new_pid in pids.items():
        meta.append({"ph": "M", "name": "process_name", "pid": new_pid, "tid": 0, "args": {"name": names[key]}})
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": new_pid, "tid": 0, "args": {"sort_index": new_pid}}
        )
    return {
        "traceEvents": meta + merged,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "hasten profile-report",
            "ranks": [t.rank for t in traces],
            "sources": {str(t.rank): [os.path.basename(p) for p in t.files] for t in traces},
        },
    }


def _host_pid(events: list[dict[str, Any]], labels: dict[Any, str]) -> Any:
    """The process row holding the CPU operators (the rank's own process)."""
    for pid, label in labels.items():
        if label == "CPU":
            return pid
    counts: dict[Any, int] = defaultdict(int)
    for e in events:
        if e.get("cat") in _HOST_CATS or e.get("cat") == "user_annotation":
            counts[e.get("pid")] += 1
    return max(counts, key=lambda p: counts[p]) if counts else None


# ---------------------------------------------------------------------- chart

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer": "#55A868",
    "data": "#C44E52",
    "other": "#B8B8B8",
}


def _import_matplotlib() -> tuple[Any, Any] | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def write_chart(summaries: list[RankSummary], path: str, top: int = 10, title: str = "") -> bool:
    """Write the PNG chart; False (and nothing written) when matplotlib is not installed."""
    mpl = _import_matplotlib()
    if mpl is None:
        return False
    Figure, FigureCanvasAgg = mpl
    ranks = [s.rank for s in summaries]
    names = top_names([s.ops for s in summaries], min(top, 10))
    height = max(4.0, 0.42 * max(len(ranks), len(names)) + 1.8)
    fig = Figure(figsize=(13, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.15])

    # Step-time breakdown per rank: one stacked bar each, the step time written at its end.
    y = list(range(len(ranks)))
    start = [0.0] * len(ranks)
    steps_ms = [s.breakdown.step_us / 1000 if s.breakdown else 0.0 for s in summaries]
    longest = max(steps_ms, default=0.0)
    for phase in PHASE_NAMES:
        widths = [(s.breakdown.phases_us[phase] / 1000 if s.breakdown else 0.0) for s in summaries]
        bars = left.barh(y, widths, left=start, color=_COLORS[phase], label=phase, height=0.55)
        for bar, w in zip(bars, widths):
            if longest and w / longest > 0.09:
                left.text(
                    bar.get_x() + w / 2,
                    bar.get_y() + bar.get_height() / 2,
                    f"{w:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        start = [a + b for a, b in zip(start, widths)]
    for i, total in enumerate(steps_ms):
        left.text(total, i, f" {total:.1f} ms", ha="left", va="center", fontsize=8)
    left.set_xlim(0, longest * 1.18 if longest else 1)
    left.set_ylim(len(ranks) - 0.4 if len(ranks) > 1 else 0.9, -0.6 if len(ranks) > 1 else -0.9)
    left.set_yticks(y, [f"rank {r}" for r in ranks])
    left.set_xlabel("ms per step (mean over the profiled steps)")
    has_breakdown = any(s.breakdown is not None for s in summaries)
    left.set_title("Step time by phase" if has_breakdown else "Step time by phase (no hasten labels found)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5, frameon=False, fontsize=8)
    left.grid(axis="x", alpha=0.3)

    # Top operators by self CPU time, one bar per rank.
    n = len(ranks)
    bar_h = 0.8 / n
    # Rank colours, distinct from the phase colours on the left.
    cmap = ["#2F4B7C", "#A05195", "#FFA600", "#665191", "#D45087", "#003F5C", "#FF7C43", "#7A7A7A"]
    for i, s in enumerate(summaries):
        ys = [j - 0.4 + bar_h * (i + 0.5) for j in range(len(names))]
        vals = [s.ops[k].self_us / 1000 if k in s.ops else 0.0 for k in names]
        right.barh(ys, vals, height=bar_h, color=cmap[i % len(cmap)], label=f"rank {s.rank}")
    right.set_yticks(list(range(len(names))), [_cut(k, 36) for k in names], fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("self CPU time, ms (summed over the profiled steps)")
    right.set_title(f"Top {len(names)} operators by self CPU time")
    if n > 1:
        right.legend(loc="lower right", fontsize=8)
    right.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path)
    return True


# ---------------------------------------------------------------------- command line


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {raw!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the output_trace_dir holding trace_rank<N>.json files")
    parser.add_argument("--top", type=_positive_int, default=10, help="how many operators to list (default: 10)")
    parser.add_argument(
        "--merged", metavar="PATH", default=None, help=f"where to write the merged trace (default: DIR/{MERGED_NAME})"
    )
    parser.add_argument("--png", metavar="PATH", default=None, help=f"where to write the chart (default: DIR/{PNG_NAME})")
    parser.add_argument("--no-png", action="store_true", help="do not draw the chart")


def run(args: argparse.Namespace) -> int:
    """Print the report, write the merged trace and the chart; 0 on success, 2 on bad traces."""
    try:
        traces = load_traces(args.dir)
    except TraceError as e:
        print(f"hasten profile-report: error: {e}", file=sys.stderr)
        return 2
    summaries = analyse(traces)
    print(format_report(summaries, args.top), end="")

    merged_path = args.merged or os.path.join(args.dir, MERGED_NAME)
    with open(merged_path, "w", encoding="utf-8") as f:
        json.dump(merge_traces(traces), f)
    print(f"\nmerged trace (one process row per rank): {merged_path}  (open it in https://ui.perfetto.dev)")

    if not args.no_png:
        png_path = args.png or os.path.join(args.dir, PNG_NAME)
        steps = max((s.breakdown.steps for s in summaries if s.breakdown), default=0)
        title = f"hasten profile report: {len(traces)} rank{'s' if len(traces) != 1 else ''}" + (
            f", {steps} profiled steps" if steps else ""
        )
        if write_chart(summaries, png_path, args.top, title):
            print(f"chart: {png_path}")
        else:
            print(f"chart: skipped, matplotlib is not installed; install it with: {INSTALL_HINT}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hasten profile-report", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
