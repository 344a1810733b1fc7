"""``hasten profile-report DIR``: read the per-rank traces of ``accelerator.profile()``.

It prints (1) the top operators by self time with their spread across ranks, and a per-step
time breakdown (forward / backward / optimizer / data, from hasten's labels), writes (2) one
merged Chrome trace in which each rank is its own process row (open it in
https://ui.perfetto.dev or chrome://tracing), and (3) a PNG chart of both (needs matplotlib:
``pip install 'hasten[report]'``; without it, (1) and (2) are still done).

This module reads JSON only: it does not import torch, so it runs anywhere the traces are.
Run it as ``hasten profile-report DIR`` or ``python -m hasten.report DIR``.

It refuses before it touches anything: every trace must be a regular file (not a folder, a
device such as ``/dev/zero`` or a pipe) of at most ``--max-trace-mb`` MB (default 1024), the
output files are created before the traces are read, each event is checked for the fields
the report reads (errors name the file, the event and the field), and traces of different
runs (world sizes that differ, cycles of one rank written by two processes, ranks recorded
more than a minute apart) are refused. Traces are read streaming, an event at a time with
``json``'s own decoder, twice (the report, then the merged trace, written an event at a
time): memory stays bounded whatever the traces' size (about 50 MB for a 189 MB trace).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any

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
    "write_merged_trace",
    "check_event",
    "DEFAULT_MAX_TRACE_MB",
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
_PROCESS_META = ("process_name", "process_labels", "process_sort_index")  # rows the merged trace renames
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class TraceError(ValueError):
    """A trace file that is missing, unreadable or not a Chrome trace (the message names it)."""


# ---------------------------------------------------------------------- reading

# A trace larger than this is refused unless --max-trace-mb raises it (reading is streamed, so
# memory stays bounded; the limit keeps a wrong file from taking minutes).
DEFAULT_MAX_TRACE_MB = 1024
# Traces of one run overlap in time; ranks whose recordings lie further apart come from different runs.
RUN_GAP_S = 60.0
_CHUNK_CHARS = 1 << 20
_MAX_VALUE_CHARS = 64 << 20  # one event (or one top-level value other than traceEvents)
_SPACE = re.compile(r"[ \t\n\r]*")
_FLOW_PHASES = ("s", "t", "f")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _JsonStream:
    """One JSON object read from a file a chunk at a time: its members one by one, and the
    items of an array member one by one, each decoded by ``json``'s own ``raw_decode``. The
    text held at once is a chunk plus the value being decoded, whatever the file's size."""

    def __init__(self, path: str, binary: Any, limit_bytes: int) -> None:
        self.path = path
        self.binary = binary
        self.limit = limit_bytes
        self.read_bytes = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.json = json.JSONDecoder()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.lines_before = 0  # newlines in the text already dropped from the buffer
        self.column_before = 0  # characters after the last of them

    def _more(self, at_least: int = _CHUNK_CHARS) -> bool:
        if self.eof:
            return False
        data = self.binary.read(at_least)
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise TraceError(f"trace {self.path} grew past {self.limit} bytes while it was read")
        try:
            text = self.decoder.decode(data, final=not data)
        except UnicodeDecodeError:
            raise TraceError(f"trace {self.path} is not a text (JSON) file") from None
        if not data:
            self.eof = True
        if self.pos:
            dropped = self.buf[: self.pos]
            newlines = dropped.count("\n")
            self.lines_before += newlines
            self.column_before = len(dropped) - dropped.rfind("\n") - 1 if newlines else self.column_before + len(dropped)
            self.buf = self.buf[self.pos :] + text
            self.pos = 0
        else:
            self.buf += text
        return bool(data) or bool(text)

    def error(self, message: str, pos: int | None = None) -> TraceError:
        pos = self.pos if pos is None else pos
        newlines = self.buf.count("\n", 0, pos)
        line = self.lines_before + newlines + 1
        column = pos - self.buf.rfind("\n", 0, pos) if newlines else self.column_before + pos + 1
        return TraceError(
            f"trace {self.path} is not valid JSON ({message} at line {line}, column {column}); "
            "is it truncated or not a trace?"
        )

    def peek(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = self.json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self.eof:
                    raise self.error(e.msg, e.pos) from None
                held = len(self.buf) - self.pos
                if held > _MAX_VALUE_CHARS:
                    raise TraceError(
                        f"trace {self.path}: a value at line {self.lines_before + self.buf.count(chr(10), 0, self.pos) + 1} "
                        f"is larger than {_MAX_VALUE_CHARS} characters, or is not valid JSON ({e.msg})"
                    ) from None
                self._more(max(_CHUNK_CHARS, held))  # the value may go on in the next chunk; decode again
                continue
            if end == len(self.buf) and self._more():  # a number may go on in the next chunk
                continue
            self.pos = end
            return value

    def expect(self, char: str, what: str) -> None:
        if self.peek() != char:
            raise self.error(f"Expecting {what}")
        self.pos += 1

    def members(self) -> Iterator[str]:
        """The keys of the top-level object; after each, the caller reads its value."""
        self.expect("{", "a JSON object")
        if self.peek() == "}":
            self.pos += 1
        else:
            while True:
                if self.peek() != '"':
                    raise self.error("Expecting property name enclosed in double quotes")
                key = self.value()
                self.expect(":", "':' delimiter")
                yield key
                if self.peek() == ",":
                    self.pos += 1
                    continue
                self.expect("}", "',' delimiter")
                break
        if self.peek():
            raise self.error("Extra data")

    def items(self) -> Iterator[Any]:
        """The items of the array that comes next."""
        self.expect("[", "'['")
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("]", "',' delimiter")
            return


def check_event(path: str, index: int, event: Any) -> dict[str, Any]:
    """``event`` if it has the shape the report reads; a TraceError naming the file, the event and the field otherwise."""
    if not isinstance(event, dict):
        raise TraceError(f"trace {path}: traceEvents[{index}] is {event!r:.60}, not an event object")

    def bad(field: str, allowed: str) -> TraceError:
        return TraceError(
            f"trace {path}: traceEvents[{index}] ({event.get('name')!r:.60}) has {field}={event[field]!r:.60}; "
            f"{field} must be {allowed}"
        )

    for key in ("ph", "name", "cat"):
        if key in event and not isinstance(event[key], str):
            raise bad(key, "a string")
    for key in ("pid", "tid"):
        value = event.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise bad(key, "an integer or a string")
    if "ts" in event and not _is_number(event["ts"]):
        raise bad("ts", "a finite number (µs)")
    if event.get("ph") == "X":
        if not (_is_number(event.get("ts")) and _is_number(event.get("dur"))):
            raise TraceError(
                f"trace {path}: traceEvents[{index}] ({event.get('name')!r:.60}) is a complete event "
                "without numeric 'ts' and 'dur'"
            )
        if event["dur"] < 0:
            raise bad("dur", "a duration >= 0 (µs)")
    if "args" in event and not isinstance(event["args"], dict):
        raise bad("args", "an object")
    if event.get("ph") in _FLOW_PHASES and "id" in event and (
        isinstance(event["id"], bool) or not isinstance(event["id"], (int, str))
    ):
        raise bad("id", "an integer or a string")
    return event


class _Names:
    """Operator names interned to small integers (a trace repeats a few hundred names)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []

    def id(self, name: str) -> int:
        found = self.ids.get(name)
        if found is None:
            found = self.ids[name] = len(self.names)
            self.names.append(name)
        return found


class _Thread:
    """The complete events of one thread, as three packed arrays (20 bytes an event)."""

    def __init__(self) -> None:
        self.ts = array("d")
        self.dur = array("d")
        self.name = array("l")

    def add(self, ts: float, dur: float, name: int) -> None:
        self.ts.append(ts)
        self.dur.append(dur)
        self.name.append(name)

    def self_times(self, names: _Names, stats: dict[str, OpStats]) -> None:
        """Add each event's call, total and self time (its time not spent in nested events)."""
        ts, dur, name = self.ts, self.dur, self.name
        n = len(ts)
        order: Iterable[int] = range(n)
        if any(ts[i] > ts[i + 1] or (ts[i] == ts[i + 1] and dur[i] < dur[i + 1]) for i in range(n - 1)):
            order = sorted(range(n), key=lambda i: (ts[i], -dur[i]))
        stack: list[list] = []  # [end, name id, dur, time in direct children]

        def finish(frame: list) -> None:
            s = stats[names.names[frame[1]]]
            s.calls += 1
            s.total_us += frame[2]
            s.self_us += max(0.0, frame[2] - frame[3])

        for i in order:
            start = ts[i]
            while stack and start >= stack[-1][0]:
                finish(stack.pop())
            if stack:
                stack[-1][3] += dur[i]
            stack.append([start + dur[i], name[i], dur[i], 0.0])
        while stack:
            finish(stack.pop())


@dataclass
class TraceFile:
    """What one trace file holds, gathered in one streaming pass (the events themselves are not kept)."""

    path: str
    rank: int
    cycle: int | None
    base_ns: int = 0
    world_size: int | None = None
    recorded_rank: int | None = None
    host_name: str | None = None
    events: int = 0
    host: dict[tuple[Any, Any], _Thread] = field(default_factory=dict)
    device: dict[tuple[Any, Any], _Thread] = field(default_factory=dict)
    annotations: list[dict[str, Any]] = field(default_factory=list)  # user_annotation ranges: name, ts, dur
    labels: dict[Any, str] = field(default_factory=dict)  # pid -> process_labels ("CPU", "GPU 0", ...)
    busy: dict[Any, int] = field(default_factory=dict)  # pid -> CPU operators and ranges on it
    rows: dict[Any, None] = field(default_factory=dict)  # pids of the events, in order of appearance
    max_flow_id: int = -1
    start_us: float = math.inf
    end_us: float = -math.inf

    @property
    def host_pid(self) -> Any:
        """The process row holding the CPU operators (the rank's own process)."""
        for pid, label in self.labels.items():
            if label == "CPU":
                return pid
        return max(self.busy, key=lambda p: self.busy[p]) if self.busy else None

    @property
    def span_s(self) -> tuple[float, float] | None:
        """When the file's events were recorded (seconds, on the clock common to every rank)."""
        if self.start_us > self.end_us:
            return None
        base = self.base_ns / 1e9
        return base + self.start_us / 1e6, base + self.end_us / 1e6


@dataclass
class RankTrace:
    """One rank's trace files, read: what the report and the merged trace need of them."""

    rank: int
    files: list[TraceFile]
    names: _Names
    world_size: int | None = None
    shift_us: dict[str, float] = field(default_factory=dict)  # path -> µs to add for the common clock

    @property
    def annotations(self) -> list[dict[str, Any]]:
        """The rank's user_annotation ranges as complete events, on the common clock."""
        return [
            {**a, "ts": a["ts"] + self.shift_us.get(f.path, 0.0), "ph": "X", "cat": "user_annotation"}
            for f in self.files
            for a in f.annotations
        ]


def _file_stat(path: str, limit_bytes: int) -> int:
    """Refuse what is not a regular file (a folder, a device such as /dev/zero, a pipe) or too large."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a device, a pipe or a socket"
        raise TraceError(f"trace {path} is not a regular file ({kind}{' behind a link' if os.path.islink(path) else ''})")
    if info.st_size > limit_bytes:
        raise TraceError(
            f"trace {path} is {info.st_size / 1e6:.1f} MB, more than the limit of {limit_bytes / 1e6:.0f} MB; "
            f"to read it anyway, raise the limit: --max-trace-mb {math.ceil(info.st_size / 1e6)}"
        )
    return info.st_size


def _scan(f: TraceFile, names: _Names, limit_bytes: int) -> None:
    """Read ``f.path`` once, streaming: check every event and keep what the report needs."""
    try:
        binary = open(f.path, "rb")
    except OSError as e:
        raise TraceError(f"cannot read trace {f.path}: {e.strerror or e}") from None
    with binary:
        stream = _JsonStream(f.path, binary, limit_bytes)
        if not stream.peek():
            raise TraceError(f"trace {f.path} is empty (was the process stopped while writing it?)")
        if stream.peek() != "{":
            raise _not_chrome(f.path)
        seen = set()
        for key in stream.members():
            if key in seen:
                raise TraceError(f"trace {f.path}: the key {key!r} appears twice")
            seen.add(key)
            if key == "traceEvents":
                if stream.peek() != "[":
                    raise _not_chrome(f.path)
                for index, event in enumerate(stream.items()):
                    _keep(f, names, check_event(f.path, index, event))
            else:
                _header(f, key, stream.value())
    if "traceEvents" not in seen:
        raise _not_chrome(f.path)


def _not_chrome(path: str) -> TraceError:
    return TraceError(
        f"trace {path} is not a Chrome trace: expected a JSON object with a 'traceEvents' list "
        "(as written by accelerator.profile() or torch.profiler's export_chrome_trace)"
    )


def _header(f: TraceFile, key: str, value: Any) -> None:
    if key == "baseTimeNanoseconds":
        if not (_is_number(value) and value >= 0):
            raise TraceError(f"trace {f.path}: baseTimeNanoseconds={value!r:.60} must be a number >= 0 (ns)")
        f.base_ns = int(value)
    elif key == "host_name" and isinstance(value, str):
        f.host_name = value
    elif key == "distributedInfo" and isinstance(value, dict):
        for name in ("rank", "world_size"):
            got = value.get(name)
            if got is not None and (isinstance(got, bool) or not isinstance(got, int) or got < (name == "world_size")):
                raise TraceError(
                    f"trace {f.path}: distributedInfo.{name}={got!r:.60} must be an integer >= {int(name == 'world_size')}"
                )
        f.recorded_rank = value.get("rank")
        f.world_size = value.get("world_size")


def _keep(f: TraceFile, names: _Names, e: dict[str, Any]) -> None:
    f.events += 1
    ph, pid = e.get("ph"), e.get("pid")
    if ph == "M":
        if e.get("name") == "process_labels":
            f.labels[pid] = str((e.get("args") or {}).get("labels", ""))
        if e.get("name") in _PROCESS_META:
            return
    f.rows.setdefault(pid, None)
    if ph in _FLOW_PHASES and isinstance(e.get("id"), int):
        f.max_flow_id = max(f.max_flow_id, e["id"])
    if ph != "X":
        return
    ts, dur, cat = e["ts"], e["dur"], e.get("cat")
    if ts < f.start_us:
        f.start_us = ts
    if ts + dur > f.end_us:
        f.end_us = ts + dur
    if cat in _HOST_CATS or cat == "user_annotation":
        f.busy[pid] = f.busy.get(pid, 0) + 1
    if cat in _HOST_CATS:
        threads = f.host
    elif cat in _DEVICE_CATS:
        threads = f.device
    elif cat == "user_annotation":
        f.annotations.append({"name": e.get("name", "?"), "ts": ts, "dur": dur})
        return
    else:
        return
    key = (pid, e.get("tid"))
    thread = threads.get(key)
    if thread is None:
        thread = threads[key] = _Thread()
    thread.add(ts, dur, names.id(str(e.get("name", "?"))))


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


def load_traces(directory: str, max_trace_mb: float = DEFAULT_MAX_TRACE_MB) -> list[RankTrace]:
    """Read every rank's traces in ``directory`` (streamed: memory does not grow with the files'
    size); errors name the file at fault. Every file is checked (a regular file, at most
    ``max_trace_mb`` MB) before any is read, and traces of different runs are refused."""
    limit = int(max_trace_mb * 1e6)
    files = [TraceFile(p, r, c) for p, r, c in find_trace_files(directory)]
    for f in files:
        _file_stat(f.path, limit)
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
    names: dict[int, _Names] = {rank: _Names() for rank in by_rank}
    for f in files:
        _scan(f, names[f.rank], limit)
    _check_one_run(files, by_rank)
    world_sizes = {f.world_size for f in files} - {None}
    expected = max([max(by_rank) + 1, *world_sizes])
    for rank in range(expected):
        if rank not in by_rank:
            raise TraceError(
                f"missing trace for rank {rank}: {os.path.join(directory, trace_file_name(rank))} "
                f"(or its _cycle<k> files) not found, but the traces show {expected} ranks"
            )
    base = min(f.base_ns for f in files)
    return [
        RankTrace(rank, by_rank[rank], names[rank], expected, {f.path: (f.base_ns - base) / 1000.0 for f in by_rank[rank]})
        for rank in sorted(by_rank)
    ]


def _clock(seconds: float, absolute: bool) -> str:
    if not absolute:
        return f"{seconds:.1f} s"
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _check_one_run(files: list[TraceFile], by_rank: dict[int, list[TraceFile]]) -> None:
    """Refuse a folder whose traces come from different runs (they would be merged as one)."""
    sizes = {f.world_size for f in files} - {None}
    if len(sizes) > 1:
        listed = "; ".join(f"{os.path.basename(f.path)}: {f.world_size}" for f in files if f.world_size is not None)
        raise TraceError(
            f"traces of different runs are mixed in {os.path.dirname(files[0].path)}: their world sizes differ "
            f"({listed}); keep one run's files in the folder"
        )
    for f in files:
        if f.recorded_rank is not None and f.recorded_rank != f.rank:
            raise TraceError(
                f"trace {f.path} was recorded by rank {f.recorded_rank} (its distributedInfo), not rank {f.rank} "
                "as its name says: was it renamed or copied from another run?"
            )
    for rank, group in by_rank.items():
        writers = {(f.host_name, f.host_pid) for f in group if f.host_pid is not None}
        if len(writers) > 1:
            listed = "; ".join(f"{os.path.basename(f.path)}: process {f.host_pid}" for f in group)
            raise TraceError(
                f"the traces of rank {rank} were written by different processes ({listed}): they come from "
                "different runs; keep one run's files in the folder"
            )
    spans = {
        rank: (min(s[0] for s in ss), max(s[1] for s in ss))
        for rank, group in by_rank.items()
        if (ss := [s for f in group if (s := f.span_s) is not None])
    }
    if len(spans) < 2:
        return
    absolute = all(f.base_ns for f in files)
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    end, end_rank = ordered[0][1][1], ordered[0][0]
    for rank, (start, stop) in ordered[1:]:
        if start - end > RUN_GAP_S:
            raise TraceError(
                f"traces of different runs are mixed in {os.path.dirname(files[0].path)}: rank {end_rank}'s events end at "
                f"{_clock(end, absolute)} and rank {rank}'s begin at {_clock(start, absolute)}, {start - end:.0f} s later "
                f"(the ranks of one run record at the same time); keep one run's files in the folder"
            )
        if stop > end:
            end, end_rank = stop, rank


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


def write_chart(summaries: list[RankSummary], path: str | IO[bytes], top: int = 10, title: str = "") -> bool:
    """Write the PNG chart (to a path or a binary file); False (and nothing written) when matplotlib is not installed."""
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
    fig.savefig(path, format="png")
    return True


# ---------------------------------------------------------------------- command line


def _number_argument(parse: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=``: the text parsed by ``parse`` and accepted by ``ok``, else "must be ``what``"."""

    def check(raw: str) -> Any:
        try:
            value = parse(raw)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {raw!r}")
        return value

    return check


_positive_int = _number_argument(int, "an integer >= 1", lambda value: value >= 1)
_megabytes = _number_argument(float, "a number of MB > 0", lambda value: math.isfinite(value) and value > 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the output_trace_dir holding trace_rank<N>.json files")
    parser.add_argument("--top", type=_positive_int, default=10, help="how many operators to list (default: 10)")
    parser.add_argument(
        "--merged", metavar="PATH", default=None, help=f"where to write the merged trace (default: DIR/{MERGED_NAME})"
    )
    parser.add_argument("--png", metavar="PATH", default=None, help=f"where to write the chart (default: DIR/{PNG_NAME})")
    parser.add_argument("--no-png", action="store_true", help="do not draw the chart")
    parser.add_argument(
        "--max-trace-mb",
        metavar="MB",
        type=_megabytes,
        default=DEFAULT_MAX_TRACE_MB,
        help=f"refuse a trace file larger than this many MB (default: {DEFAULT_MAX_TRACE_MB}); traces are read "
        "streaming, so memory stays bounded, but a larger file takes longer",
    )


class _Output:
    """An output file, created (so checked) before any work: written to a temporary file in its
    folder, which replaces the target only when complete."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        if os.path.isdir(path):
            raise TraceError(f"cannot write the {what} to {path}: it is a folder; give a file path")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise TraceError(f"cannot write the {what} to {path}: the folder {folder} does not exist")
        try:
            fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        except OSError as e:
            raise TraceError(f"cannot write the {what} to {path}: {e.strerror or e} (in {folder})") from None
        os.close(fd)

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


def run(args: argparse.Namespace) -> int:
    """Print the report, write the merged trace and the chart; 0 on success, 2 on bad traces or outputs."""
    outputs: list[_Output] = []
    try:
        merged = _Output(args.merged or os.path.join(args.dir, MERGED_NAME), "merged trace")
        outputs.append(merged)
        png = None
        if not args.no_png and _import_matplotlib() is not None:
            png = _Output(args.png or os.path.join(args.dir, PNG_NAME), "chart")
            outputs.append(png)
        traces = load_traces(args.dir, args.max_trace_mb)
    except TraceError as e:
        for output in outputs:
            output.discard()
        print(f"hasten profile-report: error: {e}", file=sys.stderr)
        return 2
    try:
        summaries = analyse(traces)
        print(format_report(summaries, args.top), end="")

        with open(merged.tmp, "w", encoding="utf-8") as f:
            write_merged_trace(traces, f, args.max_trace_mb)
        merged.commit()
        print(f"\nmerged trace (one process row per rank): {merged.path}  (open it in https://ui.perfetto.dev)")

        if png is not None:
            steps = max((s.breakdown.steps for s in summaries if s.breakdown), default=0)
            title = f"hasten profile report: {len(traces)} rank{'s' if len(traces) != 1 else ''}" + (
                f", {steps} profiled steps" if steps else ""
            )
            with open(png.tmp, "wb") as f:
                write_chart(summaries, f, args.top, title)
            png.commit()
            print(f"chart: {png.path}")
        elif not args.no_png:
            print(f"chart: skipped, matplotlib is not installed; install it with: {INSTALL_HINT}")
    finally:
        for output in outputs:
            output.discard()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hasten profile-report", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
