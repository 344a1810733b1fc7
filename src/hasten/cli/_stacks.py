"""Where each rank was when ``hasten launch`` stopped a job: a hung collective, a stop, a Ctrl-C.

Each worker (``hasten.cli._child``) has Python's faulthandler write every thread's stack to
``stack.txt`` (beside torch's error file) when a stop signal reaches it, from its C signal
handler, so a rank blocked inside a C++ collective says where it was too. A rank that failed
with an exception left its traceback in the error file instead. From these the launcher tells:

* which rank did not arrive: a rank whose error is a collective timeout (gloo's ``Timed out
  waiting ...ms``, NCCL's watchdog, a store's ``wait timeout``) or a lost peer, or whose stack
  ends inside ``torch.distributed`` (or in the autograd engine, where DDP and FSDP reduce
  gradients), waited; a rank stopped anywhere else did not reach the collective;
* or that the ranks wait in different collectives (each one's line in the script shows which).

The launcher tells it when a rank's collective timed out, and when a signal stopped the job
while a rank was inside a collective. ``hang_lines`` gives the short account (the user's line
first, then where in torch the rank was); every thread's full stack goes to the rank's log.
No torch import here.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import linecache
import os
import re
import sysconfig
import tokenize
from dataclasses import dataclass

from hasten.cli._child import STACK_FILE
from hasten.cli._child import _shown_path as _shown

_HEADER = re.compile(r"^hasten: rank (\d+), pid (\d+), main thread (0x[0-9a-fA-F]+)")
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call first\):")
_DUMP_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
_TRACE_FRAME = re.compile(r'^\s+File "(.*)", line (\d+), in (.+)$')
# A collective (or the store under it) that gave up waiting: gloo, NCCL's watchdog, the TCP store.
_TIMED_OUT = re.compile(
    r"timed out waiting|collective operation timeout|wait timeout after|socket timeout|timed out after",
    re.IGNORECASE,
)
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)|(?:waiting|timeout after|timed out after)\s*(\d+)\s*ms", re.IGNORECASE)
# A peer that left while this rank was in a collective with it.
_PEER_LEFT = re.compile(r"connection closed by peer|connection reset by peer|broken pipe|socket closed", re.IGNORECASE)


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str

    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line} in {self.func}"

    def code(self) -> str:
        """The source line, without its comment."""
        line = linecache.getline(self.path, self.line).strip() if not self.path.startswith("<") else ""
        try:
            for token in tokenize.generate_tokens(io.StringIO(line).readline):
                if token.type == tokenize.COMMENT:
                    return line[: token.start[1]].rstrip()
        except (tokenize.TokenError, SyntaxError):  # part of a statement over several lines: as it is
            pass
        return line


@dataclass
class Place:
    """Where one rank was: its main thread's frames (innermost first) and what its error said."""

    rank: int
    frames: list[Frame]
    timed_out_ms: int | None = None  # its error: a collective timed out after this long
    peer_left: bool = False  # its error: a peer left during a collective
    stack: bool = False  # the frames come from a dump at a stop signal (not an error's traceback)
    frozen: bool = False  # it was stopped (SIGSTOP, a debugger) when the launcher stopped the job

    @property
    def waiting(self) -> bool:
        """Inside a collective: its error says so, or its stack ends in one."""
        return self.timed_out_ms is not None or self.peer_left or (self.stack and _in_collective(self.frames))


def _norm(path: str) -> str:
    return path.replace(os.sep, "/")


_roots: tuple[str, ...] | None = None


def _library_roots() -> tuple[str, ...]:
    """Folders whose files are not the user's: the standard library, site-packages, torch, hasten."""
    global _roots
    if _roots is None:
        paths = sysconfig.get_paths()
        found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        found.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hasten
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.origin:
            found.add(os.path.dirname(spec.origin))
        _roots = tuple(_norm(os.path.realpath(p)).rstrip("/") + "/" for p in found if p)
    return _roots


def _is_library(frame: Frame) -> bool:
    if frame.path.startswith("<"):
        return True
    path = _norm(os.path.realpath(frame.path))
    return path.startswith(_library_roots())


def _in_collective(frames: list[Frame]) -> bool:
    """The innermost frame is in torch.distributed, or in the autograd engine (DDP's and FSDP's
    gradient collectives run under it)."""
    if not frames:
        return False
    inner = _norm(frames[0].path)
    engine = inner.endswith("/torch/autograd/graph.py") and "backward" in frames[0].func
    return "/torch/distributed/" in inner or engine


def user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame of the user's own code (not the standard library, torch or hasten)."""
    return next((f for f in frames if not _is_library(f)), None)


def collective_of(frames: list[Frame]) -> str | None:
    """The collective a rank was in: the torch.distributed function it called (``barrier``,
    ``all_reduce``, ``all_gather_single``...), else the innermost torch.distributed function,
    else ``backward`` for the autograd engine."""
    dist = [f for f in frames if "/torch/distributed/" in _norm(f.path)]
    for frame in dist:
        if _norm(frame.path).endswith("/distributed_c10d.py") and frame.func != "wrapper":
            return frame.func
    if dist:
        return dist[0].func
    if frames and _norm(frames[0].path).endswith("/torch/autograd/graph.py"):
        return "backward"
    return None


@dataclass
class Stack:
    """A worker's ``stack.txt``: its rank and pid, its main thread's frames at the first dump
    (innermost first) and the whole text of the dumps (every thread)."""

    rank: int
    pid: int
    frames: list[Frame]
    dump: str


def read_stack(path: str | None) -> Stack | None:
    """A worker's ``stack.txt``, None when it holds no dump (the worker got no stop signal)."""
    try:
        with open(path or "", encoding="utf-8", errors="replace") as fp:
            text = fp.read()
    except OSError:
        return None
    lines = text.splitlines()
    header = _HEADER.match(lines[0]) if lines else None
    if header is None or len(lines) < 2:
        return None
    main = int(header.group(3), 16)
    threads: list[tuple[int, list[Frame]]] = []
    for line in lines[1:]:
        thread = _THREAD.match(line)
        if thread:
            threads.append((int(thread.group(1), 16), []))
            continue
        frame = _DUMP_FRAME.match(line)
        if frame and threads:
            threads[-1][1].append(Frame(frame.group(1), int(frame.group(2)), frame.group(3).strip()))
    if not threads:
        return None
    ours = "/hasten/cli/_child.py"
    frames = next((f for t, f in threads if t == main), None)
    if frames is None:  # pragma: no cover - an ident faulthandler wrote otherwise: the wrapper's thread
        frames = next((f for _, f in threads if any(_norm(x.path).endswith(ours) for x in f)), threads[0][1])
    return Stack(int(header.group(1)), int(header.group(2)), frames, "\n".join(lines[1:]).strip())


def traceback_frames(trace: str) -> list[Frame]:
    """The frames of a formatted traceback's last exception, innermost first."""
    lines = trace.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    frames = []
    for line in lines[starts[-1] if starts else 0 :]:
        found = _TRACE_FRAME.match(line)
        if found:
            frames.append(Frame(found.group(1), int(found.group(2)), found.group(3).strip()))
    return frames[::-1]


def place_from_error(rank: int, message: str, trace: str) -> Place:
    """Where a rank that raised was: its traceback, and whether its error is a collective's timeout."""
    place = Place(rank, traceback_frames(trace))
    if _TIMED_OUT.search(message):
        found = _TIMEOUT_MS.search(message)
        place.timed_out_ms = int(found.group(1) or found.group(2)) if found else 0
    elif _PEER_LEFT.search(message):
        place.peer_left = True
    return place


def stack_files(log_dir: str) -> list[str]:
    """The ``stack.txt`` of every worker of the newest attempt in ``log_dir`` (torch's layout:
    ``<run id>/attempt_<n>/<local rank>/``)."""
    found = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*", "*", STACK_FILE))
    if not found:
        return []

    def attempt(path: str) -> int:
        return int(path.split("attempt_")[-1].split(os.sep)[0])

    newest = max(map(attempt, found))
    return sorted(p for p in found if attempt(p) == newest)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _at(place: Place) -> str:
    """``script.py:23 in main: code`` (the user's innermost line), or the innermost line at all."""
    frame = user_frame(place.frames) or (place.frames[0] if place.frames else None)
    if frame is None:
        return "an unknown place (no Python frame)"
    code = frame.code()
    return frame.where() + (f": {code}" if code else "")


# A frozen rank writes its stack only once the launcher continued it (SIGCONT after its stop
# signal): its main thread may have run a few lines on by then.
FROZEN = "was frozen (stopped by SIGSTOP or a debugger) until the launcher continued it to end it; it was then"
NO_STACK = "it wrote no stack: killed outright, or a signal handler of the script's own replaced the one that writes it"


def where_line(place: Place) -> str:
    """One line: the user's line, then where in torch (or hasten) the rank was under it."""
    if not place.frames:
        return f"rank {place.rank}: where it was is unknown ({NO_STACK})"
    text = f"rank {place.rank} {FROZEN if place.frozen else 'was'} at {_at(place)}"
    inner = place.frames[0] if place.frames else None
    if inner is not None and _is_library(inner) and not inner.path.startswith("<"):
        name = collective_of(place.frames) if place.waiting else None
        text += f", {f'waiting in {name}' if name else f'in {inner.func}'} ({_package_path(inner.path)}:{inner.line})"
    if place.timed_out_ms:
        text += f"; it gave up after {place.timed_out_ms / 1000:g} s"
    elif place.peer_left:
        text += "; then a peer left that collective"
    return text


def _package_path(path: str) -> str:
    """``torch/distributed/distributed_c10d.py`` rather than the site-packages path."""
    norm = _norm(path)
    for package in ("/torch/", "/hasten/"):
        if package in norm:
            return package[1:] + norm.rsplit(package, 1)[1]
    return os.path.basename(path)


def _in_what(place: Place) -> str:
    """``barrier at train.py:40 (accelerator.end_training())``."""
    text = collective_of(place.frames) or "a collective"
    frame = user_frame(place.frames)
    if frame is not None:
        code = frame.code()
        text += f" at {_shown(frame.path)}:{frame.line}" + (f" ({code})" if code else "")
    return text


def _not_arrived(absent: list[Place], waiting: list[Place], how_long: str, stopped: bool) -> str:
    """``rank 1 did not reach the collective that rank 0 waited in ...; rank 1 was at ...``."""
    if stopped:
        reached, verb = "had not reached", "was waiting in" if len(waiting) == 1 else "were waiting in"
    else:
        reached, verb = "did not reach", "waited in"
    were = "; ".join(f"rank {p.rank} {FROZEN if p.frozen else 'was'} at {_at(p)}" for p in absent)
    who, whom = _ranks([p.rank for p in absent]), _ranks([p.rank for p in waiting])
    return f"{who} {reached} the collective that {whom} {verb}{how_long}; {were}"


def _diagnosis(places: list[Place], stopped: bool) -> str:
    """The first line: who did not arrive, or that the ranks wait in different collectives."""
    # A frozen rank (SIGSTOP) makes no progress wherever its stack ends, even inside a collective's call.
    waiting = [p for p in places if p.waiting and not p.frozen]
    absent = [p for p in places if p.stack and (p.frozen or not p.waiting)]
    ms = max((p.timed_out_ms or 0 for p in waiting), default=0)
    how_long = f" for {ms / 1000:g} s (the process group's timeout, InitProcessGroupKwargs(timeout=...))" if ms else ""
    if absent:
        return _not_arrived(absent, waiting, how_long, stopped)
    if len({(collective_of(p.frames), user_frame(p.frames)) for p in waiting}) > 1:
        parts = ", ".join(f"rank {p.rank} in {_in_what(p)}" for p in waiting)
        return f"the ranks were waiting in different collectives: {parts}"
    waited = "were waiting" if stopped else "waited"
    same = f"{_ranks([p.rank for p in waiting])} {waited} in {_in_what(waiting[0])}{how_long}"
    unknown = [p.rank for p in places if not p.frames]
    if unknown:
        where = "it was" if len(unknown) == 1 else "they were"
        return f"{same}; {_ranks(unknown)} did not say where {where} ({NO_STACK})"
    if stopped:
        return same
    return f"{same}; a rank that is not on this machine did not reach it (its launcher says where it was)"


def hang_lines(places: list[Place], stopped: bool = False) -> list[str]:
    """The account of a hang: a first line naming the rank that did not arrive (or the different
    collectives the ranks wait in), then where each rank was; empty when no rank was in a collective.

    ``stopped``: the job was stopped by a signal (Ctrl-C), not ended by a collective's timeout."""
    places = sorted(places, key=lambda p: p.rank)
    if not any(p.waiting for p in places) or not (stopped or any(p.timed_out_ms is not None for p in places)):
        return []  # nothing hung: a rank that failed on its own, and peers that lost it
    named = {p.rank for p in places if p.stack and (p.frozen or not p.waiting)}  # the first line says where these were
    return [_diagnosis(places, stopped), *(where_line(p) for p in places if p.rank not in named)]
