"""What every tracker shares: ``GeneralTracker``, the ``on_main_process`` decorator, and the
helpers the built-in trackers use to import their package and to turn values into numbers.

Importing this module imports neither torch nor a tracking package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import numbers
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hasten.logging import get_logger, process_rank

__all__ = ["GeneralTracker", "on_main_process"]

logger = get_logger("hasten.tracking")


def on_main_process(function: Callable) -> Callable:
    """Decorator for tracker methods: run on the main process only when ``self.main_process_only``."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and process_rank() != 0:
            return None
        return function(self, *args, **kwargs)

    return wrapper


class GeneralTracker:
    """The base of every tracker.

    A subclass defines ``name`` (str), ``requires_logging_directory`` (bool) and a ``tracker``
    property (the underlying object, e.g. a SummaryWriter or a wandb run), and overrides
    ``start``, ``store_init_configuration``, ``log`` and ``finish`` as it needs (each does
    nothing here). ``main_process_only`` (default True) says whether only the main process
    uses it.
    """

    main_process_only: bool = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [a for a in ("name", "requires_logging_directory") if not hasattr(type(self), a)]
        if "tracker" not in dir(type(self)):
            missing.append("tracker")
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} lacks {', '.join(missing)}: a GeneralTracker subclass defines `name`, "
                "`requires_logging_directory` and a `tracker` property in its class body"
            )

    def start(self) -> None:
        """Create the run (called by ``init_trackers``, before ``store_init_configuration``)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> value) at ``step``."""

    def finish(self) -> None:
        """Close the run (called by ``end_training``)."""


class BuiltInTracker(GeneralTracker):
    """What the built-in trackers share: the package's object (a SummaryWriter, a wandb run, ...)
    lives in the attribute ``_handle`` names (Accelerate's name for it: ``writer``, ``run``,
    ``task``, ``live``, ``active_run``), None until ``start``. ``tracker`` returns it and ``finish``
    ends it with its method ``_closer`` names."""

    _handle = "run"
    _closer = "close"

    def __init__(self) -> None:
        super().__init__()
        setattr(self, self._handle, None)

    @property
    def tracker(self) -> Any:
        return getattr(self, self._handle)

    @on_main_process
    def finish(self) -> None:
        if self.tracker is not None:
            getattr(self.tracker, self._closer)()


class RunTracker(BuiltInTracker):
    """A built-in tracker built as ``cls(run_name, **kwargs)``: it keeps ``run_name`` and
    ``init_kwargs`` (the keyword arguments, for the package's run), as Accelerate's."""

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs


class ProjectRunTracker(RunTracker):
    """A tracker whose package starts a run with ``package.init(project=run_name, **kwargs)``,
    logs with ``run.log(values, step=step)`` and ends it with ``run.finish()`` (wandb, SwanLab,
    trackio). A subclass names its ``package`` and may override ``started(module)``."""

    requires_logging_directory = False
    package: str = ""
    _closer = "finish"

    @on_main_process
    def start(self) -> None:
        module = require(self.package, self.name, type(self).__name__)
        self.run = module.init(project=self.run_name, **self.init_kwargs)
        self.started(module)

    def started(self, module: ModuleType) -> None:
        """Called once the run exists (the package's module given)."""

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)


def blank_tracker() -> GeneralTracker:
    """A tracker whose methods do nothing (``get_tracker`` on a process that does not use it)."""
    return GeneralTracker(_blank=True)


def install_hint(extra: str) -> str:
    return f"pip install 'hasten[{extra}]'"


def require(package: str, extra: str, who: str) -> ModuleType:
    """Import ``package`` for ``who``; when it is not installed, an ImportError naming it and the pip extra."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{who} needs the {package!r} package: {install_hint(extra)}")
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as error:
        if error.name != package:
            raise  # the package is there but one of its own dependencies is not: its error says which
        raise ImportError(f"{who} needs the {package!r} package: {install_hint(extra)}") from error


def number(value: Any) -> int | float | None:
    """A Python/NumPy number as it is, a one-element tensor as its ``item()``, else None."""
    if isinstance(value, numbers.Real):
        return value  # type: ignore[return-value]
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1 and hasattr(value, "item"):
        return value.item()  # type: ignore[no-any-return]
    return None


def scalar(value: Any) -> float | None:
    """``number(value)`` as a float."""
    found = number(value)
    return None if found is None else float(found)


def warn_dropped(tracker: str, key: str, value: Any, takes: str) -> None:
    """Once per tracker, key and type: ``key`` was not logged because ``tracker`` takes only ``takes``."""
    logger.warning_once(f"{tracker}.log: {key!r} is a {type(value).__name__}, not logged ({tracker} logs {takes})")
