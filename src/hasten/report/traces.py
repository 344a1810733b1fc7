"""Reading the trace files: the streaming JSON reader, each event's checks, the size limit
and the one-run check; ``load_traces`` gives one ``RankTrace`` per rank."""

from __future__ import annotations

import codecs
import json
import math
import os
import re
import stat
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from hasten.training.labels import TRACE_RE, trace_file_name

_HOST_CATS = ("cpu_op",)
_PROCESS_META = ("process_name", "process_labels", "process_sort_index")  # rows the merged trace renames
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class OpStats:
    """Calls and times of one operator or range (``summary`` adds them up, ``RankTrace.self_times`` fills them)."""

    calls: int = 0
    self_us: float = 0.0
    total_us: float = 0.0


class TraceError(ValueError):
    """A trace file that is missing, unreadable or not a Chrome trace (the message names it)."""


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

    def _more(self, at_least: int | None = None) -> bool:
        if self.eof:
            return False
        data = self.binary.read(_CHUNK_CHARS if at_least is None else at_least)  # the size read at call time
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
            self.column_before = (
                len(dropped) - dropped.rfind("\n") - 1 if newlines else self.column_before + len(dropped)
            )
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
                        f"trace {self.path}: a value at line "
                        f"{self.lines_before + self.buf.count(chr(10), 0, self.pos) + 1} "
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
    """``event`` if it has the shape the report reads; a TraceError naming the file, the event and the field
    otherwise."""
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
    if (
        event.get("ph") in _FLOW_PHASES
        and "id" in event
        and (isinstance(event["id"], bool) or not isinstance(event["id"], (int, str)))
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
        raise TraceError(
            f"trace {path} is not a regular file ({kind}{' behind a link' if os.path.islink(path) else ''})"
        )
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
                    f"trace {f.path}: distributedInfo.{name}={got!r:.60} must be an integer >= "
                    f"{int(name == 'world_size')}"
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
        RankTrace(
            rank, by_rank[rank], names[rank], expected, {f.path: (f.base_ns - base) / 1000.0 for f in by_rank[rank]}
        )
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
                f"traces of different runs are mixed in {os.path.dirname(files[0].path)}: rank {end_rank}'s events "
                "end at "
                f"{_clock(end, absolute)} and rank {rank}'s begin at {_clock(start, absolute)}, {start - end:.0f} s "
                "later "
                f"(the ranks of one run record at the same time); keep one run's files in the folder"
            )
        if stop > end:
            end, end_rank = stop, rank
