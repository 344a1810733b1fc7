"""``get_logger``: a ``logging`` logger that knows about processes, as ``accelerate.logging``'s.

Every record goes through the main process only, unless ``main_process_only=False`` is
passed with it (then every process logs it), and ``in_order=True`` makes the processes log
one after the other, rank 0 first (a collective: every process must make the call)::

    from hasten.logging import get_logger

    logger = get_logger(__name__, log_level="INFO")
    logger.info("starting")                                  # once, from the main process
    logger.info("my shard has %d rows", n, main_process_only=False)
    logger.warning_once("printed once per process")

The rank comes from the process group when there is one, else from the ``RANK`` variable
that ``hasten launch`` sets (``process_rank``, which the trackers use too), so a logger works before the
``Accelerator`` exists (Accelerate refuses that). ``log_level=None`` takes
``HASTEN_LOG_LEVEL`` when it is set. ``set_verbosity`` (and ``set_verbosity_debug``, ``_info``,
``_warning``, ``_error``) sets the level of hasten's own library logger, ``"hasten"``, and
``get_verbosity`` reads it, as Accelerate 1.16's do for ``"accelerate"``. Importing this module
imports no torch.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env

__all__ = [
    "MultiProcessAdapter",
    "get_logger",
    "get_verbosity",
    "process_rank",
    "set_verbosity",
    "set_verbosity_debug",
    "set_verbosity_error",
    "set_verbosity_info",
    "set_verbosity_warning",
]

#: the library's logger: every hasten module logs under it (``logging.getLogger(__name__)``)
_LIBRARY = "hasten"

_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def _group() -> Any:
    """``torch.distributed`` when a process group exists (never imports torch itself)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def process_rank() -> int:
    """This process's rank: the process group's, else ``RANK`` (0 when unset); imports no torch."""
    dist = _group()
    if dist is not None:
        return dist.get_rank()
    return env.env_rank()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger adapter whose records carry ``main_process_only`` and ``in_order``."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        # As in Accelerate, ``stacklevel`` counts from this method (2: its caller's line); one more
        # for ``_emit``. A wrapper that passes its own stacklevel is respected.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1
        if not self.isEnabledFor(level):
            return
        if in_order:
            dist = _group()
            world = dist.get_world_size() if dist is not None else 1
            for i in range(world):
                if i == process_rank():
                    self._emit(level, msg, args, kwargs)
                if dist is not None:
                    dist.barrier()
        elif not main_process_only or process_rank() == 0:
            self._emit(level, msg, args, kwargs)

    def _emit(self, level: int, msg: object, args: tuple, kwargs: dict[str, Any]) -> None:
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)

    # logging.LoggerAdapter's debug/info/... call self.log, so they take the same keywords.

    @functools.lru_cache(None)  # noqa: B019 - one entry per (adapter, message): that is the point
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning`` the first time this adapter sees these arguments, then never again."""
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """The logger ``name`` wrapped for multi-process use (see the module docstring)."""
    if not isinstance(name, str):
        raise TypeError(f"get_logger name must be a str, got {name!r} ({type(name).__name__})")
    if log_level is None:
        log_level = env.get(env.HASTEN_LOG_LEVEL) or None
    logger = logging.getLogger(name)
    if log_level is not None:
        if isinstance(log_level, str):
            log_level = v.check_choice("get_logger", "log_level", log_level.upper(), _LEVELS)
        elif isinstance(log_level, bool) or not isinstance(log_level, int):
            raise TypeError(
                f"get_logger.log_level must be a level name ({', '.join(_LEVELS)}) or an int, got {log_level!r}"
            )
        logger.setLevel(log_level)
        logger.root.setLevel(log_level)
    return MultiProcessAdapter(logger, {})


def get_verbosity() -> int:
    """The effective level of hasten's library logger (``"hasten"``), an int such as ``logging.WARNING``."""
    return logging.getLogger(_LIBRARY).getEffectiveLevel()


def set_verbosity(verbosity: int | str) -> None:
    """Set the level of hasten's library logger (``"hasten"``), as Accelerate 1.16's sets ``"accelerate"``'s:
    a ``logging`` level (``logging.INFO``) or its name in any case (``"info"``). Loggers below it with a
    level of their own (``get_logger(name, log_level=...)``) keep it; the root logger is not changed."""
    if isinstance(verbosity, str):
        verbosity = v.check_choice("set_verbosity", "verbosity", verbosity.upper(), _LEVELS)
    elif isinstance(verbosity, bool) or not isinstance(verbosity, int):
        raise TypeError(
            f"set_verbosity.verbosity must be a level name ({', '.join(_LEVELS)}) or an int, got {verbosity!r}"
        )
    logging.getLogger(_LIBRARY).setLevel(verbosity)


def set_verbosity_debug() -> None:
    """``set_verbosity(logging.DEBUG)``."""
    set_verbosity(logging.DEBUG)


def set_verbosity_info() -> None:
    """``set_verbosity(logging.INFO)``."""
    set_verbosity(logging.INFO)


def set_verbosity_warning() -> None:
    """``set_verbosity(logging.WARNING)``."""
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    """``set_verbosity(logging.ERROR)``."""
    set_verbosity(logging.ERROR)
