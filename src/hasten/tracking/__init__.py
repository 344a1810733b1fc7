"""Experiment trackers: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``get_tracker``.

A tracker is a ``GeneralTracker`` (``base.py``): one of the built-ins, one module each, with
Accelerate's names, arguments and behaviour:

=============  ======================  ==============  ============================
``log_with``   class                   package         ``pip install 'hasten[..]'``
=============  ======================  ==============  ============================
tensorboard    ``TensorBoardTracker``  tensorboard     tracking
wandb          ``WandBTracker``        wandb           wandb
mlflow         ``MLflowTracker``       mlflow          mlflow
comet_ml       ``CometMLTracker``      comet_ml        comet_ml
clearml        ``ClearMLTracker``      clearml         clearml
aim            ``AimTracker``          aim             aim
dvclive        ``DVCLiveTracker``      dvclive         dvclive
swanlab        ``SwanLabTracker``      swanlab         swanlab
trackio        ``TrackioTracker``      trackio         trackio
=============  ======================  ==============  ============================

or any subclass a user writes and passes as an instance, or registers by name with
``register_tracker_class`` (then ``log_with="its name"`` works). ``filter_trackers`` checks
``log_with`` when the Accelerator is built: unknown names, a tracker whose package is not
installed (the error names the pip extra), a missing logging directory and (on the main
process, ``check_logging_dir``) one the trackers could not write in fail there;
``"all"`` picks the built-ins whose package is installed (``get_available_trackers``).
``Trackers`` is what the Accelerator delegates to: it builds and starts the trackers in
``init_trackers`` (as Accelerate: ``cls(project_name, **init_kwargs[name])``, with the logging
directory second for those that require one) and fans out ``log`` and ``finish``.

A tracker whose ``main_process_only`` is True (the default, and every built-in) is built,
started, logged to and finished on the main process only; on the other processes
``get_tracker`` returns a tracker whose methods do nothing. One with ``main_process_only =
False`` runs on every process.

Importing this package imports neither torch nor a tracking package: each tracker imports
its package in ``start``.
"""

from __future__ import annotations

import importlib.util
import warnings
from enum import Enum
from typing import Any

from hasten._validate import folder_problem, shown
from hasten.tracking.aim import AimTracker
from hasten.tracking.base import GeneralTracker, blank_tracker, install_hint, on_main_process
from hasten.tracking.clearml import ClearMLTracker
from hasten.tracking.comet_ml import CometMLTracker
from hasten.tracking.dvclive import DVCLiveTracker
from hasten.tracking.mlflow import MLflowTracker
from hasten.tracking.swanlab import SwanLabTracker
from hasten.tracking.tensorboard import TensorBoardTracker
from hasten.tracking.trackio import TrackioTracker
from hasten.tracking.wandb import WandBTracker

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "LoggerType",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]


class LoggerType(str, Enum):
    """The tracker names ``log_with`` accepts (Accelerate's ``LoggerType``)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every name, as Accelerate's ``BaseEnum.list()``."""
        return [member.value for member in cls]


# name -> (class, the package it imports, the hasten extra that installs it)
_BUILT_IN: dict[str, tuple[type[GeneralTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tracking"),  # in Accelerate's order
    "wandb": (WandBTracker, "wandb", "wandb"),
    "comet_ml": (CometMLTracker, "comet_ml", "comet_ml"),
    "aim": (AimTracker, "aim", "aim"),
    "mlflow": (MLflowTracker, "mlflow", "mlflow"),
    "clearml": (ClearMLTracker, "clearml", "clearml"),
    "dvclive": (DVCLiveTracker, "dvclive", "dvclive"),
    "swanlab": (SwanLabTracker, "swanlab", "swanlab"),
    "trackio": (TrackioTracker, "trackio", "trackio"),
}


# ``log_with`` names -> tracker classes: the built-ins and those ``register_tracker_class`` added.
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {name: entry[0] for name, entry in _BUILT_IN.items()}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a ``GeneralTracker`` subclass usable by name: ``Accelerator(log_with=tracker_class.name)``.

    As Accelerate's: the class must subclass ``GeneralTracker`` and define ``name`` (a non-empty
    string) and ``requires_logging_directory`` in its body; ``init_trackers`` builds it as
    ``tracker_class(project_name, **init_kwargs[name])``, with the logging directory as the second
    argument when it requires one. Registering a name again replaces the earlier class, with a warning.
    Register before creating the Accelerator that uses it.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class.tracker_class must be a subclass of GeneralTracker, got {tracker_class!r}"
        )
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"register_tracker_class: {tracker_class.__name__}.name must be a non-empty string (the log_with name), "
            f"got {name!r}"
        )
    if not isinstance(getattr(tracker_class, "requires_logging_directory", None), bool):
        raise ValueError(
            f"register_tracker_class: {tracker_class.__name__} must define requires_logging_directory = True or False "
            "(whether init_trackers passes it the logging directory)"
        )
    old = LOGGER_TYPE_TO_CLASS.get(name)
    if old is not None and old is not tracker_class:
        warnings.warn(
            f"register_tracker_class: the tracker name {name!r} ({old.__name__}) now means {tracker_class.__name__}",
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class


def _available(name: str) -> bool:
    """A registered name, or a built-in whose package is installed (found, not imported)."""
    if name not in _BUILT_IN or LOGGER_TYPE_TO_CLASS.get(name) is not _BUILT_IN[name][0]:
        return True
    try:
        return importlib.util.find_spec(_BUILT_IN[name][1]) is not None
    except (ImportError, ValueError):  # a broken install
        return False


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed here (what ``log_with="all"`` picks)."""
    return [LoggerType(name) for name in _BUILT_IN if _available(name)]


def filter_trackers(
    log_with: Any, logging_dir: Any = None, skipped: list[str] | None = None
) -> list[str | GeneralTracker]:
    """``log_with`` checked, as the Accelerator keeps it: tracker names and tracker instances, one per name.

    ``"all"`` stands for the installed built-ins (those that need a logging directory only when
    there is one). As in Accelerate, a named built-in whose package is not installed is left out
    (the run trains without it; its name is appended to ``skipped``, and ``Trackers`` warns once
    with the install command); an unknown name is a ValueError, and a tracker that needs a logging
    directory without one a ValueError.
    """
    logging_dir = None if logging_dir is None else str(logging_dir)
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    allowed = f"one of {', '.join(map(repr, LoggerType.list()))}, a GeneralTracker instance, or a list of them"
    out: list[str | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        if isinstance(item, type) and issubclass(item, GeneralTracker):
            raise TypeError(
                f"Accelerator.log_with takes tracker instances, got the class {item.__name__}: pass "
                f"{item.__name__}(...)"
            )
        if not isinstance(item, str):
            raise TypeError(f"Accelerator.log_with must be {allowed}; got {item!r} ({type(item).__name__})")
        item = str(item)  # a LoggerType member as its name
        name = item if item in LOGGER_TYPE_TO_CLASS else item.lower()
        if name == "all":
            out.extend(
                n
                for n in _BUILT_IN
                if _available(n) and (logging_dir or not LOGGER_TYPE_TO_CLASS[n].requires_logging_directory)
            )
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            registered = [n for n in LOGGER_TYPE_TO_CLASS if n not in _BUILT_IN]
            also = f" (registered: {', '.join(map(repr, registered))})" if registered else ""
            raise ValueError(f"Accelerator.log_with must be {allowed}{also}; got {item!r}")
        if not _available(name):
            if skipped is not None and name not in skipped:
                skipped.append(name)
            continue
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir`: Accelerator(log_with={item!r}) writes log files; "
                "pass project_dir=... or project_config=ProjectConfiguration(logging_dir=...)"
            )
        out.append(name)
    names = [e if isinstance(e, str) else e.name for e in out]
    return [e for i, e in enumerate(out) if names.index(names[i]) == i]  # one tracker per name


def check_logging_dir(entries: list[str | GeneralTracker], logging_dir: str | None) -> None:
    """Refuse, when the Accelerator is built, a logging directory the named trackers that write
    under it (``requires_logging_directory``: TensorBoard, Aim) could not write in: a file, a
    folder under a file, a read-only file system or folder. Nothing is created here."""
    writers = [e for e in entries if isinstance(e, str) and LOGGER_TYPE_TO_CLASS[e].requires_logging_directory]
    if not writers or logging_dir is None:
        return
    problem = folder_problem(logging_dir)
    if problem is not None:
        named = shown(writers[0] if len(writers) == 1 else writers)
        raise ValueError(
            f"Accelerator(log_with={named}) writes its logs under the logging directory {shown(logging_dir)} "
            f"(ProjectConfiguration.logging_dir, else project_dir), which {problem}: pass a folder this process "
            "may write in (created if missing) as project_dir=... or ProjectConfiguration(logging_dir=...)"
        )


_WARNED: set[str] = set()  # the missing tracker packages this process has warned about


def _warn_missing(name: str) -> None:
    """Once per process and tracker: the tracker is left out, and how to install its package."""
    if name in _WARNED:
        return
    _WARNED.add(name)
    package, extra = _BUILT_IN[name][1:]
    warnings.warn(
        f"Accelerator(log_with={name!r}): the {package!r} package is not installed, so training goes on without "
        f"the {name} tracker (its log calls do nothing); pip install {package} (or {install_hint(extra)})",
        stacklevel=4,
    )


class Trackers:
    """The trackers of one Accelerator: checked at construction, built by ``init``."""

    def __init__(self, log_with: Any, logging_dir: str | None, is_main_process: bool) -> None:
        self.skipped: list[str] = []  # named trackers whose package is not installed: left out
        self.entries = filter_trackers(log_with, logging_dir, self.skipped)
        if is_main_process:
            for name in self.skipped:
                _warn_missing(name)
        if is_main_process:  # where the built trackers write (they are built on the main process)
            check_logging_dir(self.entries, logging_dir)
        self.logging_dir = logging_dir
        self.is_main_process = is_main_process
        self.active: list[GeneralTracker] = []  # the trackers this process uses
        self._finished: set[int] = set()  # those end_training finished (a second end_training skips them)

    def _here(self, tracker: type[GeneralTracker] | GeneralTracker) -> bool:
        return self.is_main_process or not tracker.main_process_only

    def init(
        self, project_name: str, config: dict[str, Any] | None, init_kwargs: dict[str, dict[str, Any]] | None
    ) -> None:
        # A tracker instance has its own project (as in Accelerate): None is allowed when no tracker is built here.
        builds = any(not isinstance(entry, GeneralTracker) for entry in self.entries)
        if (project_name is not None or builds) and (not isinstance(project_name, str) or not project_name):
            raise TypeError(
                "init_trackers.project_name must be a non-empty string (None only when every tracker of log_with "
                f"is an instance), got {project_name!r}"
            )
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"init_trackers.config must be a dict or None, got {type(config).__name__}")
        init_kwargs = init_kwargs or {}
        if not isinstance(init_kwargs, dict):
            raise TypeError(f"init_trackers.init_kwargs must be a dict of tracker name -> dict, got {init_kwargs!r}")
        for entry in self.entries:
            if isinstance(entry, GeneralTracker):
                if self._here(entry):
                    self.active.append(entry)
                continue
            cls = LOGGER_TYPE_TO_CLASS[entry]
            if not self._here(cls):
                continue
            kwargs = dict(init_kwargs.get(entry, {}))
            args = (project_name, self.logging_dir) if cls.requires_logging_directory else (project_name,)
            self.active.append(cls(*args, **kwargs))
        for tracker in self.active:
            tracker.start()
        if config is not None:
            for tracker in self.active:
                tracker.store_init_configuration(config)

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, dict[str, Any]] | None) -> None:
        log_kwargs = log_kwargs or {}
        for tracker in self.active:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool) -> Any:
        for tracker in self.active:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if name in self.skipped or any((e if isinstance(e, str) else e.name) == name for e in self.entries):
            return blank_tracker()  # configured, but not used on this process (or not started yet)
        known = [e if isinstance(e, str) else e.name for e in self.entries]
        raise ValueError(f"get_tracker({name!r}): no such tracker; this Accelerator's trackers are {known}")

    def finish(self) -> None:
        """Finish each tracker once; the list stays (as Accelerate's ``accelerator.trackers`` after
        ``end_training``)."""
        for tracker in self.active:
            if id(tracker) not in self._finished:
                self._finished.add(id(tracker))
                tracker.finish()
