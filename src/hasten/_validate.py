"""Small checks that raise errors naming the field, the value and what is allowed.

Pure Python: used by the handlers, the Accelerator, the config file reader and the CLI,
so every entry point refuses bad input with the same words.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# The spellings of a boolean that hasten reads as text (environment variables, CLI answers).
TRUE_WORDS: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_WORDS: tuple[str, ...] = ("0", "false", "no", "off")


def _where(owner: str, field: str) -> str:
    if not field:
        return owner
    return f"{owner}.{field}" if owner else field


def check_bool(owner: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(owner, field)} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_optional_bool(owner: str, field: str, value: Any) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise TypeError(
            f"{_where(owner, field)} must be True, False or None, got {value!r} ({type(value).__name__})"
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
        shown = repr(raw) if value is None else value
        raise ValueError(f"{name} must be an integer >= 1, got {shown}".lstrip())
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
        raise TypeError(f"{_where(owner, field)} must be {kind}, got {value!r} ({type(value).__name__})")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{_where(owner, field)} must be a finite number, got {value!r}")
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
        raise ValueError(f"{_where(owner, field)} must be {allowed}, got {value!r}")
    return value


def check_choice(owner: str, field: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(
            f"{_where(owner, field)} must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r} ({type(value).__name__})"
        )
    # str-enum members compare equal to their values; normalise to the plain value.
    plain = str(value)
    if plain not in choices:
        raise ValueError(f"{_where(owner, field)} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return plain


def check_callable(owner: str, field: str, value: Any, *, optional: bool = True) -> Any:
    if value is None and optional:
        return None
    if not callable(value):
        raise TypeError(
            f"{_where(owner, field)} must be a callable{' or None' if optional else ''}, "
            f"got {value!r} ({type(value).__name__})"
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
    raise ValueError(f"{what} must be one of {words} (in any case), got {text!r}")


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean environment variable ``name``; unset or empty gives ``default``."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    return parse_bool_text(f"environment variable {name}", raw)


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a float32 tensor holds); +-inf beyond its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
