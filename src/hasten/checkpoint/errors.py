"""``CheckpointError``: a checkpoint could not be written, read or claimed, and why;
``DamagedCheckpoint``: a checkpoint's files are not what its manifest says; ``UnsafeCheckpoint``:
a file asks to run code (a class or function outside the allow-lists of ``unpickle``).

torch hides the cause of some failures: ``torch.save`` into a full disk raises ``[enforce fail at
inline_container.cc:...] unexpected pos``, and ``torch.distributed.checkpoint`` raises a
``CheckpointException`` (a ``BaseException``, which ``except Exception`` does not catch) whose
text is every rank's whole traceback. ``explain`` finds the operating system's error behind
either (``files`` keeps it with the file's path) and says it in one line that names the folder;
``explained`` wraps a step of a save or a load so that its failure is said so.

No password written in a URL (``s3://KEY:SECRET@bucket/x``) reaches a message: these errors
redact their own text (``settings.locations.redact``), and ``secrets_hidden`` re-raises any error
whose text or cause holds one with the password hidden. ``storage_failure`` makes whatever a
storage library raises one ``CheckpointError``, the same on every process (``agreed``).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from hasten.settings.locations import passwords, redact

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/hasten/


def warn_user(message: str) -> None:
    """``warnings.warn(message)`` pointing at the first caller outside hasten (the user's
    ``save_state``/``load_state`` line), however deep inside the package it is raised."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or its folder claimed; the message names the folder
    and the cause (the operating system's error and the file, where there is one). A password
    written in a URL is hidden in it (``redact``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class DamagedCheckpoint(ValueError):
    """A checkpoint file is missing, its size or checksum is not the manifest's, it cannot be
    read (truncated, garbage), or the manifest itself holds a value no save writes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


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


# ---------------------------------------------------------------------- storage failures, secrets

# What hasten raises itself for bad input or a damaged checkpoint: kept as it is, never wrapped.
_OWN = (CheckpointError, DamagedCheckpoint, ValueError, TypeError, KeyboardInterrupt)


def storage_failure(exc: BaseException, what: str, then: str = "") -> CheckpointError | None:
    """One ``CheckpointError`` for whatever a storage library raised (botocore's connection
    errors, s3fs's, an fsspec protocol's ``NotImplementedError``), saying ``what`` failed and the
    cause in one line; None for hasten's own errors and bad input (``_OWN``), raised as they are.
    Raise it ``from exc`` (``from None`` where the cause's text holds a secret: ``secrets_hidden``)."""
    found = explain(exc, what, then)
    if found is not None:
        return found
    if isinstance(exc, _OWN) or not isinstance(exc, Exception):
        return None
    cause = first_line(exc)
    if isinstance(exc, NotImplementedError):
        cause = f"{cause} (this fsspec protocol does not implement that operation: it may be read-only)"
    return CheckpointError(f"{what}: {cause}" + (f". {then}" if then else ""))


def original(exc: BaseException) -> BaseException:
    """What to chain a wrapped ``exc`` to: the first rank's own error of a DCP exception (whose
    text is every rank's whole traceback), else ``exc``."""
    if is_dcp_exception(exc) and exc.failures:
        pair = sorted(exc.failures.items())[0][1]
        inner = pair[0] if isinstance(pair, tuple) and pair else pair
        if isinstance(inner, BaseException):
            return inner
    return exc


def agreed(exc: BaseException) -> BaseException:
    """The error a process raises for a step that failed on another process (``ops.agree``'s
    ``RuntimeError: ... failed on process N: CheckpointError: ...``): a ``CheckpointError`` where
    the failing process raised one, so every process raises the same type; else ``exc``."""
    if type(exc) is RuntimeError and " failed on process " in str(exc) and ": CheckpointError: " in str(exc):
        new = CheckpointError(str(exc))
        new.__cause__ = exc.__cause__
        return new
    return exc


def _scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with each URL's password hidden (``redact``), and each of ``secrets`` wherever it
    appears on its own (a storage library quotes ``KEY:SECRET@bucket`` without its ``s3://``)."""
    text = redact(text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _leaks(exc: BaseException, secrets: tuple[str, ...]) -> bool:
    """Whether ``exc``, or anything it was raised from or during, shows a URL's password."""
    return any(_scrub(t, secrets) != t for e in _causes(exc) for t in (str(e), repr(getattr(e, "filename", None))))


def hidden(exc: BaseException, secrets: tuple[str, ...] = ()) -> BaseException | None:
    """``exc`` re-made with every URL password in its text (and its causes' texts) hidden, or None
    where nothing shows one (``secrets``: passwords to hide wherever they appear). The same type
    where it can be built from one message; a ``CheckpointError`` naming the type otherwise. The
    causes' texts go into the message: raise it ``from None``, so no traceback prints them."""
    if not _leaks(exc, secrets):
        return None
    causes = [e for e in _causes(exc) if e is not exc and str(e)]
    text = _scrub(str(exc), secrets) + "".join(f" (from {_scrub(first_line(c), secrets)})" for c in causes[:2])
    try:
        new = CheckpointError(text) if isinstance(exc, CheckpointError) else type(exc)(text)
        if str(new) != text:
            raise TypeError(type(exc).__name__)
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        new = CheckpointError(f"{type(exc).__name__}: {text}")
    return new


@contextlib.contextmanager
def secrets_hidden(*locations: Any) -> Iterator[None]:
    """Re-raise an error whose text or cause shows a password written in a URL (any, or that of
    one of ``locations``, wherever it appears) with it hidden (``hidden``)."""
    try:
        yield
    except Exception as e:
        new = hidden(e, passwords(*locations))
        if new is None:
            raise
        raise new from None
