"""``accelerate.utils.environment``: set or clear environment variables for a block, and read them
as Accelerate's helpers do.

Every read and write goes through ``hasten.settings.environment`` (the one module of hasten that
touches ``os.environ``). Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env

__all__ = [
    "are_libraries_initialized",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def _variable(owner: str, key: Any, value: Any) -> tuple[str, str]:
    """``(KEY, str(value))`` for ``os.environ``, or an error naming what the environment cannot hold."""
    if not isinstance(key, str) or not key or "=" in key or "\0" in key:
        raise ValueError(
            f"{owner}: {v.shown(key)} cannot be an environment variable's name (a non-empty string without '=' or NUL)"
        )
    text = str(value)
    if "\0" in text:
        raise ValueError(f"{owner}: the value of {key.upper()} holds a NUL character, which the environment cannot")
    return key.upper(), text


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable for the ``with`` block (the name upper-cased,
    the value as ``str(value)``), then restore each: its old value, or unset if it was unset.

    As Accelerate's. Every name and value is checked before any is set: a refused call sets nothing.
    """
    values = dict(_variable("patch_environment", key, value) for key, value in kwargs.items())
    with env.patched(values):
        yield


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Empty the environment for the ``with`` block; afterwards it holds exactly what it held before
    (what the block set is dropped, what it changed or unset is restored). As Accelerate's."""
    with env.cleared():
        yield


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 for y, yes, t, true, on, 1 and 0 for n, no, f, false, off, 0 (any case); True/False with
    ``to_bool``. Other text is a ValueError naming it and the spellings."""
    if not isinstance(value, str):
        raise TypeError(f"str_to_bool.value must be a string, got {v.shown(value)} ({type(value).__name__})")
    lowered = value.lower()
    if lowered not in _TRUE + _FALSE:
        raise ValueError(f"invalid truth value {value!r}: one of {', '.join(_TRUE)} or {', '.join(_FALSE)} (any case)")
    result = lowered in _TRUE
    return result if to_bool else int(result)


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """The first of these variables that holds an integer >= 0, else ``default`` (as Accelerate's:
    a variable set to text that is not an integer is a ValueError naming it)."""
    for key in env_keys:
        raw = env.get(key)
        value = -1 if raw is None else v.parse_int_text(f"environment variable {key}", raw)
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether variable ``key`` is set to a true spelling (see ``str_to_bool``); ``default`` when unset."""
    return str_to_bool(env.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Variable ``key``'s text, ``str(default)`` when unset."""
    return env.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` that are imported in this process (in ``sys.modules``)."""
    return [name for name in library_names if name in sys.modules]


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=value\\n`` lines (for an env file) of the items whose key and value are not empty and
    hold none of ``; \\n < >`` or a space; each item left out is logged as a warning."""
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            from hasten.logging import get_logger

            get_logger(__name__).warning(
                f"WARNING: Skipping {key}={value} as it contains forbidden characters or missing values."
            )
    return lines


#: the variables ``purge_accelerate_environment`` keeps as they were: Accelerate's, and hasten's own
_PURGED = ("ACCELERATE_", env.PREFIX)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator: after the function (or each ``test*`` method of the class and its subclasses),
    the ``ACCELERATE_*`` variables (and hasten's ``HASTEN_*``) are as they were before the call
    (for tests: ``TrainingArguments(fp16=True)`` exports ``ACCELERATE_MIXED_PRECISION``)."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with env.kept(_PURGED):
                return func(*args, **kwargs)

        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        v.check_callable("purge_accelerate_environment", "func_or_cls", func_or_cls, optional=False)
        return wrap(func_or_cls)

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method):
                if not hasattr(method, "_accelerate_is_purged_environment_wrapped"):
                    setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kw: wrap_tests(cls))  # type: ignore[assignment]
    return func_or_cls
