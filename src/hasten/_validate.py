"""Small checks that raise errors naming the field, the value and what is allowed.

Pure Python: used by the handlers, the Accelerator, the config file reader and the CLI,
so every entry point refuses bad input with the same words.
"""

from __future__ import annotations

import math
import os
import reprlib
import stat
import struct
from collections.abc import Callable, Iterable
from typing import Any

# The spellings of a boolean that hasten reads as text (environment variables, CLI answers).
TRUE_WORDS: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_WORDS: tuple[str, ...] = ("0", "false", "no", "off")


class _Shown(reprlib.Repr):
    """``reprlib``'s short repr, with dicts in their own order (not sorted) and huge ints summed up
    (``repr`` of an int of more than 4300 digits raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = 160
        self.maxlong = 100
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 12

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(x[k], level - 1)}" for k in list(x)[: self.maxdict]]
        return "{" + ", ".join(items + ["..."] * (len(x) > self.maxdict)) + "}"


# How much of a value an error message shows: a value read from a file or the command line may be
# huge (a YAML alias bomb stands for a billion items), and the message must stay short.
_SHOWN = _Shown()
MAX_SHOWN = 400  # characters


def shown(value: Any) -> str:
    """``repr(value)`` cut short (at most ``MAX_SHOWN`` characters; long strings, long and deeply
    nested containers elided with ``...``): what an error message that quotes a value shows."""
    text = _SHOWN.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _where(owner: str, field: str) -> str:
    if not field:
        return owner
    return f"{owner}.{field}" if owner else field


def check_bool(owner: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(owner, field)} must be True or False, got {shown(value)} ({type(value).__name__})")
    return value


def check_optional_bool(owner: str, field: str, value: Any) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise TypeError(
            f"{_where(owner, field)} must be True, False or None, got {shown(value)} ({type(value).__name__})"
        )
    return value


def parse_positive_int(name: str, raw: str) -> int:
    """Text (a flag's value, an environment variable) as an integer >= 1, else a ValueError that
    names ``name`` (left out where empty: argparse puts the flag in front itself)."""
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < 1:
        shown_raw = shown(raw) if value is None else value
        raise ValueError(f"{name} must be an integer >= 1, got {shown_raw}".lstrip())
    return value


def positive_int_argument(name: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for an integer >= 1: ``parse_positive_int``'s error as argparse's."""

    def parse(raw: str) -> int:
        import argparse

        try:
            return parse_positive_int(name, raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def check_number(
    owner: str,
    field: str,
    value: Any,
    *,
    integer: bool = False,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A real number (an int where ``integer``) inside the given bounds; bools are refused."""
    kind = "an integer" if integer else "a number"
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise TypeError(f"{_where(owner, field)} must be {kind}, got {shown(value)} ({type(value).__name__})")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{_where(owner, field)} must be a finite number, got {shown(value)}")
    bounds = []
    if gt is not None:
        bounds.append(("> ", gt, value > gt))
    if ge is not None:
        bounds.append((">= ", ge, value >= ge))
    if lt is not None:
        bounds.append(("< ", lt, value < lt))
    if le is not None:
        bounds.append(("<= ", le, value <= le))
    if not all(ok for _, _, ok in bounds):
        allowed = " and ".join(f"{op}{b}" for op, b, _ in bounds)
        raise ValueError(f"{_where(owner, field)} must be {allowed}, got {shown(value)}")
    return value


def check_choice(owner: str, field: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(
            f"{_where(owner, field)} must be one of {', '.join(map(repr, choices))}, "
            f"got {shown(value)} ({type(value).__name__})"
        )
    # str-enum members compare equal to their values; normalise to the plain value.
    plain = str(value)
    if plain not in choices:
        raise ValueError(f"{_where(owner, field)} must be one of {', '.join(map(repr, choices))}, got {shown(value)}")
    return plain


def check_callable(owner: str, field: str, value: Any, *, optional: bool = True) -> Any:
    if value is None and optional:
        return None
    if not callable(value):
        raise TypeError(
            f"{_where(owner, field)} must be a callable{' or None' if optional else ''}, "
            f"got {shown(value)} ({type(value).__name__})"
        )
    return value


def parse_bool_text(what: str, text: str, *, true: tuple[str, ...] = (), false: tuple[str, ...] = ()) -> bool:
    """``text`` read as a boolean: 1/0, true/false, yes/no, on/off (any case; ``true``/``false``
    add spellings); anything else is a ValueError naming ``what``, the text and the spellings."""
    lowered = text.strip().lower()
    if lowered in TRUE_WORDS or lowered in true:
        return True
    if lowered in FALSE_WORDS or lowered in false:
        return False
    words = ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS + true, FALSE_WORDS + false))
    raise ValueError(f"{what} must be one of {words} (in any case), got {shown(text)}")


def parse_int_text(what: str, text: str) -> int:
    """``text`` read as an integer (spaces around it allowed), else a ValueError naming ``what``."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {shown(text)}") from None


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a float32 tensor holds); +-inf beyond its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # pragma: no cover - no statvfs (Windows)
        return False


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be a folder this process writes files in, or None when it can.

    It is refused when it, or the nearest existing folder above it (where it would be created),
    is not a folder, or may not be written (read-only file system, permissions). Only reads:
    nothing is created."""
    if "\x00" in path:
        return "holds a NUL character, which no path can"
    full = probe = os.path.abspath(path)
    while True:
        try:
            info = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(probe):
                return f"cannot be created: {probe!r} is a symbolic link to a missing target"
            parent = os.path.dirname(probe)
            if parent == probe:  # pragma: no cover - the root always exists
                return None
            probe = parent
        except OSError as err:
            return f"cannot be reached: {err.strerror or err} ({probe!r})"
    what = "a file" if stat.S_ISREG(info.st_mode) else "not a folder"
    if not stat.S_ISDIR(info.st_mode):
        return f"is {what}, not a folder" if probe == full else f"cannot be created: {probe!r} is {what}"
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "on a read-only file system" if _read_only_fs(probe) else "not writable by this user"
        return f"is {why}" if probe == full else f"cannot be created: {probe!r} is {why}"
    return None


def check_writable_folder(owner: str, field: str, path: str, allowed: str) -> str:
    """``path`` when :func:`folder_problem` finds nothing, else a ValueError naming the field,
    the path, the problem and ``allowed`` (what to pass instead)."""
    problem = folder_problem(path)
    if problem is not None:
        raise ValueError(f"{_where(owner, field)} {shown(path)} {problem}: {allowed}")
    return path
