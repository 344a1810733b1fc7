"""Experiment trackers: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``, ``get_tracker``.

A tracker is a ``GeneralTracker``: the built-in ``TensorBoardTracker`` (``"tensorboard"``,
through ``torch.utils.tensorboard``) and ``WandBTracker`` (``"wandb"``), or any subclass a
user writes and passes as an instance, or registers by name with ``register_tracker_class``
(then ``log_with="its name"`` works). ``Trackers`` is what the Accelerator delegates to:
it checks ``log_with`` when the Accelerator is built (unknown names, missing packages,
a missing logging directory fail there), builds and starts the trackers in
``init_trackers`` and fans out ``log`` and ``finish``.

A tracker whose ``main_process_only`` is True (the default, and both built-ins) is built,
started, logged to and finished on the main process only; on the other processes
``get_tracker`` returns a tracker whose methods do nothing. One with ``main_process_only =
False`` runs on every process.

Importing this module imports neither torch nor a tracking package.
"""

from __future__ import annotations

import functools
import importlib.util
import numbers
import os
import warnings
from collections.abc import Callable
from enum import Enum
from typing import Any

from ..logging import process_rank

__all__ = [
    "LOGGER_TYPE_TO_CLASS", "GeneralTracker", "LoggerType", "TensorBoardTracker", "WandBTracker", "on_main_process",
    "register_tracker_class",
]


class LoggerType(str, Enum):
    """The tracker names ``log_with`` accepts."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"

    def __str__(self) -> str:
        return self.value


# Names Accelerate knows that hasten has no built-in tracker for.
_UNSUPPORTED = ("aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "trackio")


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


def _blank_tracker() -> GeneralTracker:
    return GeneralTracker(_blank=True)


def _scalar(value: Any) -> float | None:
    """A plain number for a Python/NumPy number or a one-element tensor, else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1 and hasattr(value, "item"):
        return float(value.item())
    return None


class TensorBoardTracker(GeneralTracker):
    """Logs to TensorBoard event files in ``logging_dir/run_name`` (``torch.utils.tensorboard``).

    ``log`` writes numbers (and one-element tensors) as scalars, strings as text and dicts of
    numbers as ``add_scalars`` groups; ``store_init_configuration`` writes the hyperparameters
    for TensorBoard's HParams tab. Extra keyword arguments go to ``SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        for summary in hparams(plain, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = _scalar(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, {k: _scalar(x) for k, x in value.items()}, global_step=step, **kwargs)
            else:
                raise TypeError(
                    f"TensorBoardTracker.log: {key!r} is a {type(value).__name__}; it logs numbers, one-element "
                    "tensors, strings and dicts of numbers"
                )
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is a batch of images (N, C, H, W) for ``SummaryWriter.add_images``."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandBTracker(GeneralTracker):
    """Logs to a Weights & Biases run, ``wandb.init(project=run_name, **kwargs)``.

    Offline runs (``WANDB_MODE=offline``) write under ``./wandb`` or ``dir=...``.
    """

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is a list of images (arrays or PIL images), logged as ``wandb.Image``."""
        import wandb

        self.run.log({k: [wandb.Image(image) for image in v] for k, v in values.items()}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


# name -> (class, the module that must be importable, the pip install that provides it)
_BUILT_IN: dict[str, tuple[type[GeneralTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "pip install 'hasten[tracking]' (or: pip install tensorboard)"),
    "wandb": (WandBTracker, "wandb", "pip install wandb"),
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
        raise ValueError(f"register_tracker_class.tracker_class must be a subclass of GeneralTracker, got {tracker_class!r}")
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
    return name not in _BUILT_IN or importlib.util.find_spec(_BUILT_IN[name][1]) is not None


def _entries(log_with: Any, logging_dir: str | None) -> list[str | GeneralTracker]:
    """``log_with`` checked: built-in names (available, with a logging dir if needed) and tracker instances."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    allowed = "'tensorboard', 'wandb', 'all', a GeneralTracker instance, or a list of them"
    out: list[str | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        if isinstance(item, type) and issubclass(item, GeneralTracker):
            raise TypeError(f"Accelerator.log_with takes tracker instances, got the class {item.__name__}: pass {item.__name__}(...)")
        if not isinstance(item, str):
            raise TypeError(f"Accelerator.log_with must be {allowed}; got {item!r} ({type(item).__name__})")
        name = str(item) if str(item) in LOGGER_TYPE_TO_CLASS else str(item).lower()
        if name in _UNSUPPORTED and name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"Accelerator.log_with={item!r}: hasten has no built-in {name} tracker (built in: 'tensorboard', "
                "'wandb'); write a GeneralTracker subclass for it and pass an instance, or register it "
                "(hasten.tracking.register_tracker_class)"
            )
        if name == "all":
            out.extend(n for n in _BUILT_IN if _available(n) and (logging_dir or not _BUILT_IN[n][0].requires_logging_directory))
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            registered = [n for n in LOGGER_TYPE_TO_CLASS if n not in _BUILT_IN]
            also = f" (registered: {', '.join(map(repr, registered))})" if registered else ""
            raise ValueError(f"Accelerator.log_with must be {allowed}{also}; got {item!r}")
        if not _available(name):
            raise ImportError(f"Accelerator(log_with={item!r}) needs the {_BUILT_IN[name][1]!r} package: {_BUILT_IN[name][2]}")
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir`: Accelerator(log_with={item!r}) writes log files; "
                "pass project_dir=... or project_config=ProjectConfiguration(logging_dir=...)"
            )
        out.append(name)
    names = [e if isinstance(e, str) else e.name for e in out]
    return [e for i, e in enumerate(out) if names.index(names[i]) == i]  # one tracker per name


class Trackers:
    """The trackers of one Accelerator: checked at construction, built by ``init``."""

    def __init__(self, log_with: Any, logging_dir: str | None, is_main_process: bool) -> None:
        self.entries = _entries(log_with, logging_dir)
        self.logging_dir = logging_dir
        self.is_main_process = is_main_process
        self.active: list[GeneralTracker] = []  # the trackers this process uses

    def _here(self, tracker: type[GeneralTracker] | GeneralTracker) -> bool:
        return self.is_main_process or not tracker.main_process_only

    def init(self, project_name: str, config: dict[str, Any] | None, init_kwargs: dict[str, dict[str, Any]] | None) -> None:
        if not isinstance(project_name, str) or not project_name:
            raise TypeError(f"init_trackers.project_name must be a non-empty string, got {project_name!r}")
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
        if any((e if isinstance(e, str) else e.name) == name for e in self.entries):
            return _blank_tracker()  # configured, but not used on this process (or not started yet)
        known = [e if isinstance(e, str) else e.name for e in self.entries]
        raise ValueError(f"get_tracker({name!r}): no such tracker; this Accelerator's trackers are {known}")

    def finish(self) -> None:
        for tracker in self.active:
            tracker.finish()
        self.active = []
