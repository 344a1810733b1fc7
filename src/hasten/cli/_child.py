"""One worker of ``hasten launch``: ``python -m hasten.cli._child (script.py | -m module) [args]``.

Runs the script (or module) as ``python script.py`` (``python -m module``) would: same
``sys.argv``, ``sys.path[0]``, ``__name__ == "__main__"`` and absolute ``__file__``. Around it:

* An uncaught exception is written to the error file that torch.distributed.run's agent
  names in ``TORCHELASTIC_ERROR_FILE`` (the format of torch's ``@record``) and the worker exits
  with status 1. The launcher prints the traceback of the rank that failed first, once; so on
  the last attempt the worker itself prints nothing (with restarts left, it prints its traceback
  as usual, since the launcher will not).
* A fatal signal (SIGABRT, SIGSEGV, ...) leaves Python's faulthandler report in ``fault.txt``
  beside the error file: the launcher shows it, and its time says when the rank died.
* A stop signal (SIGTERM, SIGINT, SIGHUP: what torch's agent sends to stop a worker) first has
  Python's faulthandler write every thread's stack to ``stack.txt`` beside the error file, from
  its C signal handler, so even a rank blocked inside a C++ collective says where it was; then
  the signal takes its usual course (``chain=True``). The launcher reads these to say which rank
  did not reach a collective (``hasten.cli._stacks``). A script that sets its own handler for one
  of these signals replaces this one.
* A warning is one line (``file:line: Category: message``), printed by rank 0; other ranks
  print only warnings that name a rank by number (``rank 3 ...``), and log the rest beside the error file.
* A closed stdout (``hasten launch ... | head``) ends the worker quietly (status 141, as SIGPIPE
  would), and the launcher says nothing about it.
* The worker dies with its launcher (Linux): torch's agent starts each worker in a session of
  its own, so a launcher killed outright (SIGKILL, the OOM killer) would leave it running, still
  in the job's collectives: the other machines would train on with an orphan that no agent
  watches, and could never restart without it. The launcher names itself in
  ``HASTEN_LAUNCHER_PID``; the worker asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), and ends at once if that parent is already gone.
* The worker ends in order, while the interpreter is whole (``_exit_in_order``): it waits for the
  script's threads, runs the atexit handlers (the script's, logging's, and hasten's, which
  destroys the process group), flushes open files, then leaves with ``os._exit``, as
  multiprocessing's workers do, skipping the interpreter's own teardown. That teardown raced
  torch's gloo threads: a gloo worker thread still letting go of a finished collective's tensors
  needs the GIL, and a thread taking the GIL once the interpreter is finalizing is ended by
  ``pthread_exit``, which unwinds through a C++ destructor: ``terminate called without an
  active exception``, SIGABRT, exit status 134 after a script that succeeded. Python does not
  promise to call ``__del__`` of objects alive at exit; nothing else is skipped.

No torch import here: the script imports what it needs.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import io
import json
import os
import re
import runpy
import signal
import sys
import threading
import time
import traceback
import warnings
from types import TracebackType
from typing import Any, NoReturn, TextIO

from hasten.settings import environment

_OWN_FILES = {__file__, getattr(runpy, "__file__", None), "<frozen runpy>"}
_RANK_WORDS = re.compile(r"\branks?\s*\d", re.IGNORECASE)  # "rank 3", "ranks 0 and 2"
_keep_open: list[TextIO] = []  # faulthandler's file must stay open for the life of the process


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this wrapper's and runpy's frames."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    return tb


def _log_dir() -> str | None:
    path = environment.get(environment.TORCHELASTIC_ERROR_FILE)
    return os.path.dirname(path) if path else None


# hasten's errors whose message says all (the folder, the file, the field): the launcher shows the
# message alone, the traceback goes to the rank's log (hasten.checkpoint.errors; matched by name,
# so that this wrapper imports no torch)
_KNOWN_ERRORS = frozenset({"CheckpointError", "DamagedCheckpoint", "UnsafeCheckpoint"})
_HASTEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _known_error(exc: BaseException, tb: TracebackType | None) -> bool:
    """A hasten error of a known kind: a checkpoint error, or a ValueError/TypeError that hasten's
    own code raised (its validation: the innermost frame is in hasten, not torch, not the script)."""
    if any(c.__module__.startswith("hasten.") and c.__name__ in _KNOWN_ERRORS for c in type(exc).__mro__):
        return True
    if not isinstance(exc, (ValueError, TypeError)) or tb is None:
        return False
    if type(exc).__module__ != "builtins" and not type(exc).__module__.startswith("hasten."):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return path.startswith(_HASTEN_DIR + os.sep) and path != os.path.abspath(__file__)


def _write_error_file(exc: BaseException, tb: TracebackType | None, **extra: Any) -> None:
    path = environment.get(environment.TORCHELASTIC_ERROR_FILE)
    if not path:
        return
    if _known_error(exc, tb):
        extra["hasten_known"] = True
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(now)),
                "hasten_time": now,  # sub-second, to tell which rank failed first
                **extra,
            },
        }
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # whole or not at all: torch's agent reads the file as soon as the process is gone, and a
        # rank stopped while writing it left an empty file that crashed the agent (JSONDecodeError)
        part = f"{path}.{os.getpid()}.part"
        with open(part, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
        os.replace(part, path)
    except OSError:  # pragma: no cover - the launcher then reports the exit code only
        pass


def _last_attempt() -> bool:
    try:
        attempt = int(environment.get(environment.TORCHELASTIC_RESTART_COUNT, "0"))
        return attempt >= int(environment.get(environment.TORCHELASTIC_MAX_RESTARTS, "0"))
    except ValueError:  # pragma: no cover - torch always sets integers
        return True


def _enable_faulthandler(folder: str | None) -> None:
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        fp = open(os.path.join(folder, "fault.txt"), "w", encoding="utf-8")  # noqa: SIM115 - kept open on purpose
    except OSError:  # pragma: no cover - then Python's default (no report) applies
        return
    _keep_open.append(fp)
    faulthandler.enable(file=fp, all_threads=False)


# The signals torch's agent stops a worker with (its default TORCHELASTIC_SIGNALS_TO_HANDLE, less
# SIGQUIT, whose default action already dumps core).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
STACK_FILE = "stack.txt"


def _enable_stack_dumps(folder: str | None, rank: int) -> None:
    """At a stop signal, write every thread's stack to ``stack.txt``, then let the signal act."""
    if folder is None or not hasattr(faulthandler, "register"):  # not on Windows
        return
    try:
        fp = open(os.path.join(folder, STACK_FILE), "w", encoding="utf-8")  # noqa: SIM115 - kept open on purpose
        # The launcher reads which rank and thread this is; faulthandler's dumps follow.
        fp.write(f"hasten: rank {rank}, pid {os.getpid()}, main thread 0x{threading.main_thread().ident:016x}\n")
        fp.flush()
    except OSError:  # pragma: no cover - then the launcher shows no stack for this rank
        return
    _keep_open.append(fp)
    signals = [getattr(signal, name) for name in STOP_SIGNALS]
    for signum in signals:
        faulthandler.register(signum, file=fp, all_threads=True, chain=True)
    # A forked child (a DataLoader worker: torch's agent signals the worker's whole process group)
    # must not write its own stack into this rank's file.
    os.register_at_fork(after_in_child=lambda: [faulthandler.unregister(signum) for signum in signals])


def _shown_path(filename: str) -> str:
    """A path relative to the working directory when it lies under it, as the user would write it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # pragma: no cover - another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


def _install_warning_format(rank: int, folder: str | None) -> None:
    """One line per warning, once, from rank 0 (other ranks: only warnings about a rank)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
        text = f"{_shown_path(filename)}:{lineno}: {category.__name__}: {message}".replace("\n", " ")
        if rank == 0 or _RANK_WORDS.search(str(message)):
            stream = file if file is not None else sys.stderr
            try:
                stream.write((f"[rank{rank}] " if rank else "") + text + "\n")
            except (OSError, ValueError):  # a closed stream: the warning is lost, as with Python's own
                pass
        elif folder is not None:
            try:
                with open(os.path.join(folder, "warnings.txt"), "a", encoding="utf-8") as fp:
                    fp.write(text + "\n")
            except OSError:  # pragma: no cover
                pass

    warnings.showwarning = show


def _quiet_stdout() -> None:
    """After EPIPE on stdout: point it at /dev/null so the interpreter's final flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover
        pass


def _exit_status(code: object) -> int:
    """The status ``raise SystemExit(code)`` gives, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except (OSError, ValueError):  # pragma: no cover - a closed stderr
        pass
    return 1


def _join_threads() -> None:
    """Wait for the script's non-daemon threads, as the interpreter does before its atexit handlers:
    first the callbacks ``threading._register_atexit`` registered (``concurrent.futures`` stops its idle
    pool workers there; joined without it, a live ``ThreadPoolExecutor``'s workers waited forever)."""
    for callback in reversed(getattr(threading, "_threading_atexits", [])):
        callback()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon and thread.is_alive():
            thread.join()


def _flush_open_files() -> None:
    """Flush every open Python file: the interpreter's teardown would have, by closing them."""
    with warnings.catch_warnings():
        # isinstance() on every object: some warn when asked for their class (torch's deprecated
        # torch.distributed.reduce_op prints a FutureWarning at every exit otherwise).
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, io.IOBase):
                try:
                    if not obj.closed and obj.writable():
                        obj.flush()
                except (OSError, ValueError):  # a closed pipe, a detached buffer: nothing to flush there
                    pass


def _exit_in_order(status: int) -> NoReturn:
    """End the worker with ``status``: threads, atexit handlers, files, then ``os._exit`` (see the top)."""
    try:
        _join_threads()
        atexit._run_exitfuncs()  # prints a handler's traceback and goes on, as at interpreter exit
        _flush_open_files()
    except KeyboardInterrupt:  # pragma: no cover - Ctrl-C during the shutdown
        status = status or 128 + signal.SIGINT
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: its content is lost, as it would be anyway
                pass
        os._exit(status)


# Seconds a worker whose error names another process (hasten.distributed.ops.agree: "... failed on process N:")
# waits before it exits, so that process records its own error first (see main).
PEER_REPORT_GRACE = 2.0
_FAILED_ON = re.compile(r"\bfailed on process (\d+): ")


def _names_another_process(exc: BaseException, rank: int) -> bool:
    found = _FAILED_ON.search(str(exc))
    return found is not None and int(found.group(1)) != rank


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_launcher() -> None:
    """SIGKILL this worker when the launcher that started it dies (Linux; elsewhere nothing)."""
    launcher = environment.get(environment.HASTEN_LAUNCHER_PID, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # pragma: no cover - never fails on Linux
            return
    except (OSError, AttributeError):  # pragma: no cover - no C library to call
        return
    if os.getppid() != int(launcher):  # it died before the request: no signal will come
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> int:
    """Run the script; return the worker's exit status (the caller ends the process with it)."""
    if not argv:
        raise SystemExit("usage: python -m hasten.cli._child (script.py | -m module) [args]")
    _die_with_launcher()
    rank = int(environment.get(environment.RANK, "0") or 0)
    folder = _log_dir()
    _enable_faulthandler(folder)
    _enable_stack_dumps(folder, rank)
    _install_warning_format(rank, folder)
    try:
        if environment.env_flag(environment.HASTEN_AS_ACCELERATE):  # hasten launch --as_accelerate
            from hasten.compat.as_accelerate import install_as_accelerate  # no torch either

            install_as_accelerate()
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module puts the module's path in sys.argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            path = os.path.abspath(argv[0])
            sys.path[0] = os.path.dirname(os.path.realpath(path))  # as `python script.py` does
            runpy.run_path(path, run_name="__main__")
        sys.stdout.flush()  # a closed pipe shows here rather than at interpreter exit
    except BrokenPipeError as exc:
        _quiet_stdout()
        _write_error_file(exc, _user_frames(exc.__traceback__), hasten_broken_pipe=True)
        return 128 + signal.SIGPIPE
    except SystemExit as exc:
        return _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        if not folder:  # not under hasten launch: as Python reports it
            raise
        # Ctrl-C reaches the launcher, whose agent passes SIGINT to every worker: the launcher
        # says it in one line ("stopped by SIGINT"), as for SIGTERM; a traceback per rank (dozens
        # of lines in a save) would bury it. The error file keeps the traceback for a worker
        # interrupted alone (the launcher then shows it as that rank's failure).
        _write_error_file(exc, _user_frames(exc.__traceback__))
        return 128 + signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - report it the way an uncaught exception is reported
        tb = _user_frames(exc.__traceback__)
        _write_error_file(exc, tb)
        if not folder or not _last_attempt():
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.stderr.flush()
        if folder and _names_another_process(exc, rank):
            # Told by a collective step that another process failed: that process is still
            # unwinding its own error. Leaving at once would have the agent stop it (SIGTERM)
            # before it records that error, and the launcher could show only this echo of it.
            time.sleep(PEER_REPORT_GRACE)
        return 1
    return 0


if __name__ == "__main__":
    _exit_in_order(main(sys.argv[1:]))
