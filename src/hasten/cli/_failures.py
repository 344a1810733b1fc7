"""How ``hasten launch`` ends a job and says why: Ctrl-C (the workers stopped within seconds,
where each rank was), a rendezvous that failed, and a failed job (which rank failed first and
why, which rank did not reach a collective that timed out: ``hang_report``, from the stacks
``hasten.cli._stacks`` reads)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Collection, Sequence
from typing import Any

# Seconds the workers get to end after Ctrl-C before they are killed. torch's agent passes SIGINT on
# and waits its shutdown timeout (30 s) for them, but a rank blocked inside a collective never
# sees a SIGINT: it stays in C++ code, where Python cannot raise KeyboardInterrupt.
INTERRUPT_GRACE = 1.5


class _CtrlC:
    """While the agent runs: Ctrl-C (SIGINT) stops the workers as torch's agent does (SIGINT to
    each, then wait), and kills (SIGKILL, with its process group) each one still running
    ``INTERRUPT_GRACE`` seconds later. torch is told not to handle SIGINT itself (its
    ``--signals-to-handle``); this handler raises what torch's own would, ``SignalException``.
    Before any worker runs (a rendezvous waiting for other machines) it is Python's
    ``KeyboardInterrupt``, as before. Only in the main thread, and only when SIGINT is among the
    signals torch would handle."""

    def __init__(self, namespace: Any) -> None:
        import threading

        handled = getattr(namespace, "signals_to_handle", None)
        names = [n.strip() for n in handled.split(",")] if isinstance(handled, str) else []
        self.active = "SIGINT" in names and threading.current_thread() is threading.main_thread()
        if self.active:
            namespace.signals_to_handle = ",".join(n for n in names if n != "SIGINT")
        self.previous: Any = None
        self.killer: Any = None
        self.killed: list[int] = []  # the workers still running after the grace

    def __enter__(self) -> None:
        if self.active:
            self.previous = signal.signal(signal.SIGINT, self._interrupted)

    def __exit__(self, *exc: object) -> None:
        if self.active and self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _interrupted(self, signum: int, frame: Any) -> None:
        import threading

        from torch.distributed.elastic.multiprocessing.api import SignalException

        workers = _worker_pids()
        if not workers:
            raise KeyboardInterrupt
        if self.killer is None:
            self.killer = threading.Thread(
                target=_kill_after, args=(workers, INTERRUPT_GRACE, self.killed), daemon=True
            )
            self.killer.start()
        raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals.SIGINT}", sigval=signal.SIGINT)


class ContinueStopped:
    """While the agent runs: each time torch's agent sends a worker its stop signal (SIGTERM when
    another rank failed, SIGINT on Ctrl-C), SIGCONT follows it, to the worker's process group. A
    rank frozen by SIGSTOP (or a debugger's stop) would act on the signal only when continued, so
    the agent waited its 30 s shutdown timeout, then SIGKILLed it, and the rank never said where it
    was; continued, it writes its stack (``hasten.cli._child``) and ends at once."""

    def __init__(self) -> None:
        self.frozen: set[int] = set()  # the pids of the workers that were stopped when told to end

    def __enter__(self) -> None:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        self.cls = subprocess_handler.SubprocessHandler
        self.original = original = self.cls.close

        def close(handler: Any, death_sig: Any = None) -> None:
            if _state_of(handler.proc.pid) in (b"T", b"t"):
                self.frozen.add(handler.proc.pid)
            original(handler, death_sig)
            try:
                os.killpg(handler.proc.pid, signal.SIGCONT)
            except (OSError, AttributeError):  # ended meanwhile; or not a process group (Windows)
                pass

        self.cls.close = close

    def __exit__(self, *exc: object) -> None:
        self.cls.close = self.original


def _stat_of(pid: int) -> list[bytes] | None:
    """The fields of Linux's /proc/PID/stat after the command name (state, parent, ...); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            stat = fp.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _state_of(pid: int) -> bytes | None:
    """A process's state letter (``T``: stopped), None when it is gone (or not Linux)."""
    fields = _stat_of(pid)
    return fields[0] if fields else None


def _parent_of(pid: int) -> int | None:
    """The parent of a live process (Linux's /proc), None when it is gone or has ended (a zombie)."""
    fields = _stat_of(pid)
    if fields is None:
        return None
    state, ppid = fields[:2]
    return None if state in (b"Z", b"X") else int(ppid)


def _worker_pids() -> list[int]:
    """The live children of this process: the workers torch's agent started (Linux; else none)."""
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux: torch's agent waits its shutdown timeout
        return []
    me = os.getpid()
    return [int(n) for n in names if n.isdigit() and _parent_of(int(n)) == me]


def _kill_after(pids: list[int], grace: float, killed: list[int]) -> None:
    """SIGKILL each of ``pids`` (and its process group: a DataLoader's workers) still a live child
    of this process after ``grace`` seconds; those are added to ``killed``."""
    import time

    deadline = time.monotonic() + grace
    me = os.getpid()
    while time.monotonic() < deadline and any(_parent_of(p) == me for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _parent_of(pid) != me:
            continue
        killed.append(pid)
        try:
            if os.getpgid(pid) == pid:  # torch starts each worker in a session of its own
                os.killpg(pid, signal.SIGKILL)
            else:  # pragma: no cover
                os.kill(pid, signal.SIGKILL)
        except OSError:  # ended meanwhile
            pass


def stopped_report(log_dir: str, shown: str | None, killed: Sequence[int] = ()) -> list[str]:
    """After a signal stopped the job: where each rank was when the stop signal reached it, from
    the stacks the workers wrote then (``hasten.cli._stacks``), when a rank was inside a
    collective (not, e.g., when every rank was in ``time.sleep``), or where each rank in
    ``killed`` (pids still running ``INTERRUPT_GRACE`` s after Ctrl-C) was. With ``shown`` (the
    log folder is kept), each rank's whole dump goes to ``rank<N>.log`` there, and a line names them."""
    from hasten.cli import _stacks

    stacks = [s for s in map(_stacks.read_stack, _stacks.stack_files(log_dir)) if s is not None]
    places = [_stacks.Place(s.rank, s.frames, stack=True) for s in stacks]
    lines = _stacks.hang_lines(places, stopped=True)
    if not lines:
        lines = [
            f"rank {p.rank} did not end within {INTERRUPT_GRACE:g} s of SIGINT and was killed; "
            + _stacks.where_line(p).replace(f"rank {p.rank} was at", "it was at", 1)
            for s, p in zip(stacks, places)
            if s.pid in killed
        ]
    lines = [f"hasten launch: {line}" for line in lines]
    if not lines or shown is None:
        return lines
    for stack in stacks:
        try:
            with open(os.path.join(log_dir, f"rank{stack.rank}.log"), "w", encoding="utf-8") as fp:
                fp.write(f"rank {stack.rank}: every thread's stack when the stop signal reached it\n{stack.dump}\n")
        except OSError:  # pragma: no cover - the summary is still printed
            pass
    return [*lines, f"hasten launch: every thread's stack of each rank: {os.path.join(shown, 'rank<N>.log')}"]


def rendezvous_failure_message(err: BaseException, log_dir: str) -> str:
    """One short block for a rendezvous that failed (torch's traceback goes to the log folder)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return (
        f"hasten launch: the rendezvous failed: {type(err).__name__}: {first}\n"
        "hasten launch: the machine hosting it (--rdzv_endpoint / --main_process_ip) may be gone, or too few "
        "machines joined within join_timeout (--rdzv_conf); a lost machine is survived only when it is not the "
        "rendezvous host (see README, Resizing and restarts)\n"
        f"hasten launch: full logs: {log_dir}"
    )


def _message(failure: Any) -> dict[str, Any]:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    return message if isinstance(message, dict) else {}


def _fault_file(failure: Any, log_dir: str | None, name: str = "fault.txt") -> str | None:
    """Where the worker's faulthandler writes (``name``: ``fault.txt`` at a fatal signal,
    ``stack.txt`` at a stop signal): beside its error file (in the newest attempt's folder)."""
    error_file = getattr(failure, "error_file", None)
    if error_file and os.path.isabs(error_file):
        return os.path.join(os.path.dirname(error_file), name)
    if log_dir is None:
        return None
    import glob

    found = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*", str(failure.local_rank), name))
    return max(found, key=lambda p: int(p.split("attempt_")[-1].split(os.sep)[0]), default=None)


def hang_report(
    failures: dict[int, Any], log_dir: str | None, frozen: Collection[int] = ()
) -> tuple[list[str], dict[int, str]]:
    """When a rank's collective timed out: which rank did not reach it, or in which different
    collectives the ranks waited, and where each rank was (``hasten.cli._stacks``), from each rank's
    error (its traceback) or, for a rank the launcher stopped, the stack it wrote at that signal.
    Also each rank's whole stack dump, for its log. No lines when no collective timed out.
    ``frozen``: the pids of workers that were stopped (SIGSTOP) when the agent told them to end."""
    from hasten.cli import _stacks
    from hasten.cli._child import STACK_FILE

    places, dumps = [], {}
    for rank, failure in failures.items():
        message = _message(failure)  # a rank stopped while it ended after its own error: told by that error
        stopped = failure.exitcode < 0 and not message
        found = _stacks.read_stack(_fault_file(failure, log_dir, STACK_FILE)) if stopped else None
        if found is not None:
            places.append(_stacks.Place(rank, found.frames, stack=True, frozen=failure.pid in frozen))
            dumps[rank] = found.dump
            continue
        trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
        places.append(_stacks.place_from_error(rank, str(message.get("message", "")), trace))
    return [f"hasten launch: {line}" for line in _stacks.hang_lines(places)], dumps


def _fault_report(fault: str | None) -> str:
    """What Python's faulthandler wrote for a worker killed by a fatal signal (SIGABRT, SIGSEGV, ...):
    the error line and the user's frames (not the wrapper's, not the list of extension modules)."""
    if fault is None:
        return ""
    try:
        with open(fault, encoding="utf-8", errors="replace") as fp:
            text = fp.read()
    except OSError:
        return ""
    kept = []
    for line in text.strip().splitlines():
        if line.startswith("Extension modules:"):
            break
        if '"<frozen runpy>"' in line or "hasten/cli/_child.py" in line.replace(os.sep, "/"):
            continue
        kept.append(line)
    return "\n".join(kept).strip()


def _traceback_of(failure: Any, fault: str | None = None) -> str:
    message = _message(failure)
    if message:
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message", "")).rstrip()
    report = _fault_report(fault)
    if report:
        return report
    if isinstance(failure.message, str) and "pytorch.org/docs" not in failure.message:
        if re.match(r"Signal \d+ \(\w+\) received by PID \d+$", failure.message.strip()):
            return ""  # torch's words for "no error file": the exit code says the same
        return failure.message.rstrip()
    return ""


def _how(failure: Any) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
    return f"exited with code {failure.exitcode}"


def _failed_at(failure: Any, fault: str | None = None) -> float:
    """When a worker failed: the sub-second time hasten's worker wrapper recorded (an exception),
    else when faulthandler wrote its report (a fatal signal), else the end of the second torch
    noted (whole seconds, taken when the agent saw the failure)."""
    extra = _message(failure).get("extraInfo", {})
    if "hasten_time" in extra:
        return float(extra["hasten_time"])
    if fault is not None:
        try:
            if os.path.getsize(fault) > 0:
                return os.path.getmtime(fault)
        except OSError:
            pass
    return failure.timestamp + 0.999


# What a rank says when it failed because a peer died: such a rank did not fail first.
_PEER_LOSS = (
    "connection closed by peer",
    "connection reset by peer",
    "typically caused by a remote worker crashing",
    "broken pipe",
    "socket closed",
)
# hasten's agreement on a collective step (hasten.distributed.ops.agree): "<what> failed on process N: <its error>".
_FAILED_ON = re.compile(r"\bfailed on process (\d+): ")
# The shown part of a long traceback: its first and last lines (all of it is in rank<N>.log).
TRACE_HEAD, TRACE_TAIL = 12, 30
ERROR_LINES = 6  # the most lines of an exception's message shown as its error line(s)


def _blamed(failure: Any, rank: int) -> int | None:
    """The rank this failure's message says failed (hasten's ``agree``), when it is another one."""
    found = _FAILED_ON.search(str(_message(failure).get("message", "")))
    return int(found.group(1)) if found and int(found.group(1)) != rank else None


def _consequence(failure: Any, rank: int) -> bool:
    """A failure caused by another rank's: stopped by the agent (SIGTERM), lost a peer
    mid-collective, or told by a collective step that another rank failed."""
    if failure.exitcode == -signal.SIGTERM or _blamed(failure, rank) is not None:
        return True
    text = str(_message(failure).get("message", "")).lower()
    return any(words in text for words in _PEER_LOSS)


def _broken_pipe(failure: Any) -> bool:
    return bool(_message(failure).get("extraInfo", {}).get("hasten_broken_pipe"))


def _known(failure: Any) -> bool:
    """The worker raised a hasten error of a known kind (``hasten.cli._child._known_error``):
    its message says all, its traceback is for the rank's log only."""
    return bool(_message(failure).get("extraInfo", {}).get("hasten_known"))


def _raised_at(failure: Any) -> str:
    """`` at script.py:23 in main: code``: the user's innermost line in the failure's traceback."""
    from hasten.cli import _stacks

    trace = str(_message(failure).get("extraInfo", {}).get("py_callstack", ""))
    frame = _stacks.user_frame(_stacks.traceback_frames(trace))
    if frame is None:
        return ""
    code = frame.code()
    return f" at {frame.where()}" + (f": {code}" if code else "")


def _exception_lines(text: str) -> list[str]:
    """An exception's own line(s), ``Type: message``, from ``text`` (a message, or the end of a
    traceback): a message that embeds other tracebacks (torch.distributed.checkpoint's
    CheckpointException holds one per rank) is cut there, and each embedded one adds its own
    final line, prefixed with what its header names (``(RANK 0)``)."""
    lines = text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    own = lines[: starts[0]] if starts else lines
    own = [line for line in own if line.strip()][:ERROR_LINES]
    for k, start in enumerate(starts):
        block = lines[start : starts[k + 1] if k + 1 < len(starts) else len(lines)]
        tag = block[0].removeprefix("Traceback (most recent call last):").strip()
        last = _final_exception(block)
        if last:
            own.append(f"{tag + ' ' if tag else ''}{last[0]}")
    return own


def _final_exception(traceback_lines: list[str]) -> list[str]:
    """The lines after a traceback's last frame: its exception's ``Type: message`` (and notes)."""
    end = len(traceback_lines)
    while end > 0 and not traceback_lines[end - 1].strip():
        end -= 1
    start = end
    while start > 0 and not traceback_lines[start - 1].startswith((" ", "\t", "Traceback (most recent call last)")):
        start -= 1
    return [line for line in traceback_lines[start:end] if line.strip()][:ERROR_LINES]


def _error_of(failure: Any) -> list[str]:
    """The failure's exception line(s), as the worker recorded them (nothing for a worker that died
    without raising)."""
    message = _message(failure)
    text = str(message.get("message", "")).strip()
    if text:
        return _exception_lines(text)
    trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
    return _final_exception(trace.splitlines()) if trace else []


def _shortened(trace: str, log: str | None) -> str:
    """A traceback of at most TRACE_HEAD + TRACE_TAIL lines (the whole one is in the rank's log)."""
    lines = trace.splitlines()
    if len(lines) <= TRACE_HEAD + TRACE_TAIL + 1:
        return trace
    where = f"; all of it is in {log}" if log else ""
    left_out = len(lines) - TRACE_HEAD - TRACE_TAIL
    return "\n".join([*lines[:TRACE_HEAD], f"  ... ({left_out} lines left out{where}) ...", *lines[-TRACE_TAIL:]])


def _write_rank_logs(
    failures: dict[int, Any], faults: dict[int, str | None], log_dir: str, dumps: dict[int, str] | None = None
) -> None:
    for rank, failure in failures.items():
        trace = _traceback_of(failure, faults[rank]) or "(no traceback: the process wrote none)"
        if dumps and rank in dumps:
            trace += f"\n---- every thread's stack of rank {rank} when the launcher stopped it ----\n{dumps[rank]}"
        path = os.path.join(log_dir, f"rank{rank}.log")
        try:
            with open(path, "w", encoding="utf-8") as fp:
                fp.write(f"rank {rank} {_how(failure)} (local rank {failure.local_rank}, pid {failure.pid})\n{trace}\n")
        except OSError:  # pragma: no cover - the summary is still printed
            pass


def first_failure(failures: dict[int, Any], faults: dict[int, str | None]) -> int:
    """The rank that failed first: one that another rank's collective step names as the one that
    failed, else the earliest failure that is not a consequence of another (stopped by the agent,
    lost its peer), by the time each worker recorded (see ``_failed_at``)."""
    named = {_blamed(f, r) for r, f in failures.items()} & set(failures)
    return min(
        failures,
        key=lambda r: (
            r not in named,
            _consequence(failures[r], r),
            _failed_at(failures[r], faults[r]),
            failures[r].exitcode < 0,
            r,
        ),
    )


def describe_failure(
    err: Any, log_dir: str | None = None, shown: str | None = None, frozen: Collection[int] = ()
) -> tuple[str, int]:
    """A short account of a ChildFailedError and the launcher's exit status.

    Names the rank that failed first (``first_failure``), shows its traceback once (at most
    TRACE_HEAD + TRACE_TAIL lines) and ends with its exception line(s), ``Type: message``, the
    cause to read; every failed rank's whole account goes to ``rank<N>.log`` in ``log_dir``.
    An empty message means: say nothing (the output pipe was closed, e.g. ``| head``).
    """
    failures = err.failures
    faults = {rank: _fault_file(failure, log_dir) for rank, failure in failures.items()}
    rank = first_failure(failures, faults)
    first = failures[rank]
    if _broken_pipe(first):
        return "", 128 + signal.SIGPIPE
    hang, dumps = hang_report(failures, log_dir, frozen)
    if log_dir is not None:
        _write_rank_logs(failures, faults, log_dir, dumps)
    trace = _traceback_of(first, faults[rank])
    error = _error_of(first)
    reporter = None
    if not error:  # stopped before it could report: what the rank that named it was told
        for other, failure in sorted(failures.items()):
            if _blamed(failure, other) == rank:
                text = str(_message(failure).get("message", ""))
                error = _exception_lines(text[_FAILED_ON.search(text).end() :])
                reporter = other
                break
    where = f"(local rank {first.local_rank}, pid {first.pid})"
    lines = hang  # first: the rank that did not reach a collective that timed out
    if reporter is not None and first.exitcode == -signal.SIGTERM:
        lines += [
            f"hasten launch: rank {rank} failed first: rank {reporter} reported its error, and the launcher "
            f"stopped rank {rank} (SIGTERM) before it reported the error itself {where}"
        ]
    elif _known(first) and error:  # its message says all: the traceback is in the rank's log only
        lines.append(f"hasten launch: rank {rank} failed first: it {_how(first)} {where}{_raised_at(first)}")
        trace = ""
    else:
        lines.append(f"hasten launch: rank {rank} failed first: it {_how(first)} {where}")
    log = os.path.join(shown or log_dir, f"rank{rank}.log") if log_dir is not None else None
    if trace:
        lines += [f"---- traceback of rank {rank} ----", _shortened(trace, log), "----"]
    elif _known(first) and log is not None:
        lines.append(f"hasten launch: rank {rank}'s traceback: {log}")
    for other in sorted(o for o in failures if o != rank):
        failure = failures[other]
        because = ""
        if _blamed(failure, other) is not None:
            because = f", after rank {_blamed(failure, other)} failed"
        elif failure.exitcode == -signal.SIGTERM:
            because = ", stopped by the launcher"
        lines.append(f"hasten launch: rank {other} also failed: it {_how(failure)}{because}")
    lines.append("hasten launch: the other workers were stopped")
    if log_dir is not None:
        lines.append(f"hasten launch: full logs of every rank: {shown or log_dir}")
    blamed = _blamed(first, rank)
    if blamed is not None:  # the rank it names runs on another machine: its own launcher shows it
        lines.append(f"hasten launch: rank {rank} was told that rank {blamed} failed (on another machine)")
    if error:
        lines.append(f"hasten launch: rank {rank} failed with {error[0]}")
        lines += [f"    {line}" for line in error[1:]]
    code = failures[reporter].exitcode if reporter is not None and first.exitcode == -signal.SIGTERM else first.exitcode
    status = code if 0 < code < 256 else (128 - code if code < 0 else 1)
    return "\n".join(lines), status
