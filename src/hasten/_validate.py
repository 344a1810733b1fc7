"""Small checks that raise errors naming the field, the value and what is allowed.

Pure Python: used by the handlers, the Accelerator, the config file reader and the CLI,
so every entry point refuses bad input with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


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
