"""``CheckpointError``: a checkpoint could not be written, read or claimed, and why;
``DamagedCheckpoint``: a checkpoint's files are not what its manifest says; ``UnsafeCheckpoint``:
a file asks to run code (a class or function outside the allow-lists of ``unpickle``).

torch hides the cause of some failures: ``torch.save`` into a full disk raises ``[enforce fail at
inline_container.cc:...] unexpected pos``, and ``torch.distributed.checkpoint`` raises a
``CheckpointException`` (a ``BaseException``, which ``except Exception`` does not catch) whose
text is every rank's whole traceback. ``explain`` finds the operating system's error behind
either (``files`` keeps it with the file's path) and says it in one line that names the folder;
``explained`` wraps a step of a save or a load so that its failure is said so.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Callable, Iterator
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or its folder claimed; the message names the folder
    and the cause (the operating system's error and the file, where there is one)."""


class DamagedCheckpoint(ValueError):
    """A checkpoint file is missing, its size or checksum is not the manifest's, it cannot be
    read (truncated, garbage), or the manifest itself holds a value no save writes."""


class UnsafeCheckpoint(DamagedCheckpoint):
    """A checkpoint file asks to load a class or function that is not data a checkpoint holds
    (``os.system``, any class outside the allow-list): refused, nothing of it is run."""


def is_dcp_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed.checkpoint's ``CheckpointException`` (without importing it)."""
    return type(exc).__name__ == "CheckpointException" and isinstance(getattr(exc, "failures", None), dict)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, what it was raised from or during, and each rank's error of a DCP exception."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if is_dcp_exception(e):
            todo.extend(pair[0] for _, pair in sorted(e.failures.items()) if isinstance(pair, tuple) and pair)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)


def os_error_in(exc: BaseException) -> OSError | None:
    """The first operating-system error (with an errno) behind ``exc``, if any."""
    return next((e for e in _causes(exc) if isinstance(e, OSError) and e.errno is not None), None)


def describe_os_error(err: OSError) -> str:
    """``No space left on device [ENOSPC] ('/path')``."""
    code = _errno.errorcode.get(err.errno or 0, str(err.errno))
    where = f" ({err.filename!r})" if err.filename else ""
    return f"{err.strerror or err} [{code}]{where}"


def first_line(exc: BaseException) -> str:
    """``Type: message`` of the first rank's error of a DCP exception, else of ``exc``; one line."""
    if is_dcp_exception(exc) and exc.failures:
        rank, pair = sorted(exc.failures.items())[0]
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        trace = pair[1] if isinstance(pair, tuple) and len(pair) > 1 else None
        frame = trace[-1] if trace else None  # where it was raised: the rest of the traceback is torch's plumbing
        at = (
            f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
            if frame is not None and hasattr(frame, "lineno")
            else ""
        )
        return f"rank {rank}: {first_line(inner)}{at}"
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def explain(exc: BaseException, what: str, then: str = "") -> CheckpointError | None:
    """A ``CheckpointError`` saying ``what`` failed, why, and (``then``) what became of it, for an
    error with an OS cause or a DCP exception; None for anything else (raised as it is).
    ``raise explain(...) from None``: the message holds the cause, torch's traceback would hide it."""
    if isinstance(exc, CheckpointError):
        return None
    os_error = os_error_in(exc)
    if os_error is not None:
        cause = describe_os_error(os_error)
    elif is_dcp_exception(exc):
        cause = f"torch.distributed.checkpoint failed on {first_line(exc)}"
    else:
        return None
    return CheckpointError(f"{what}: {cause}" + (f". {then}" if then else ""))


def explained(fn: Callable[[], Any], what: str, then: str = "", dcp_only: bool = False) -> Callable[[], Any]:
    """``fn`` whose failure caused by the operating system (disk full, no permission) or inside
    torch.distributed.checkpoint (only that with ``dcp_only``) is raised as one ``CheckpointError``
    line saying so (``explain``)."""

    def run() -> Any:
        try:
            return fn()
        except BaseException as e:
            found = explain(e, what, then) if not dcp_only or is_dcp_exception(e) else None
            if found is None:
                raise
            raise found from None

    return run
