"""The report's numbers: operators' self times, the per-step breakdown from hasten's labels,
one ``RankSummary`` per rank."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hasten.report.traces import _HOST_CATS, OpStats, RankTrace, _Names, _Thread
from hasten.training.labels import PHASES, STEP_PREFIX

PHASE_NAMES = tuple(p for p, _ in PHASES) + ("other",)
# Ranges torch itself records (dataloader iteration, optimizer methods): not the user's own.
_TORCH_RANGES = ("enumerate(DataLoader)", "Optimizer.", "DistributedDataParallel.", "gloo:", "nccl:", "## ")


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
    names = _Names()
    threads: dict[tuple[Any, Any], _Thread] = defaultdict(_Thread)
    for e in _complete(events, cats):
        threads[(e.get("pid"), e.get("tid"))].add(e["ts"], e["dur"], names.id(str(e.get("name", "?"))))
    stats: dict[str, OpStats] = defaultdict(OpStats)
    for thread in threads.values():
        thread.self_times(names, stats)
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
    steps = sorted((e for e in annotations if str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"])
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
    annotations = trace.annotations
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
    host: dict[str, OpStats] = defaultdict(OpStats)
    device: dict[str, OpStats] = defaultdict(OpStats)
    for f in trace.files:  # an operator never spans two files: each file's threads on their own
        for thread in f.host.values():
            thread.self_times(trace.names, host)
        for thread in f.device.values():
            thread.self_times(trace.names, device)
    return RankSummary(trace.rank, dict(host), dict(device), dict(user_ranges), step_breakdown(annotations))


def analyse(traces: list[RankTrace]) -> list[RankSummary]:
    return [summarise(t) for t in traces]


def top_names(per_rank: list[dict[str, OpStats]], n: int) -> list[str]:
    """The ``n`` names with the largest mean self time across ranks."""
    names = {name for ops in per_rank for name in ops}
    mean = {name: sum(ops[name].self_us for ops in per_rank if name in ops) / len(per_rank) for name in names}
    return sorted(names, key=lambda k: (-mean[k], k))[:n]
