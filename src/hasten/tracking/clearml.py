"""``ClearMLTracker`` (``log_with="clearml"``): a ClearML task.

``Task.set_offline(True)`` (or ``CLEARML_OFFLINE_MODE=1``) keeps the session in ClearML's cache
folder (``Task.get_offline_mode_folder()``) for a later ``Task.import_offline_session``.
"""

from __future__ import annotations

from typing import Any

from hasten.settings import environment as env
from hasten.tracking.base import BuiltInTracker, number, on_main_process, require, warn_dropped

__all__ = ["ClearMLTracker"]


def _title_series(name: str) -> tuple[str, str]:
    """``eval_loss`` -> ("loss", "eval"), likewise ``test_`` and ``train_``; anything else -> (name, "train")."""
    for prefix in ("eval", "test", "train"):
        if name.startswith(prefix + "_"):
            return name[len(prefix) + 1 :], prefix
    return name, "train"


class ClearMLTracker(BuiltInTracker):
    """Logs to a ClearML task, as Accelerate's ``ClearMLTracker``.

    ``start`` uses the task already running in this process (``Task.current_task()``; ``finish``
    then leaves it open), else ``Task.init(project_name=..., task_name=..., **kwargs)`` where both
    names default to ``CLEARML_PROJECT`` / ``CLEARML_TASK``, else ``run_name``.
    ``store_init_configuration`` connects the values as the task's configuration. ``log`` reports
    each number with a ``step`` as a scalar whose series is the key's ``eval_``/``test_``/``train_``
    prefix (removed from the title; "train" without one), without a step as a single value;
    anything else is left out, with a warning.
    """

    name = "clearml"
    requires_logging_directory = False
    _handle = "task"

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self._initialized_externally = False

    @on_main_process
    def start(self) -> None:
        clearml = require("clearml", "clearml", "ClearMLTracker")
        current = clearml.Task.current_task()
        if current is not None:
            self._initialized_externally = True
            self.task = current
            return
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", env.get(env.CLEARML_PROJECT, self.user_provided_run_name))
        kwargs.setdefault("task_name", env.get(env.CLEARML_TASK, self.user_provided_run_name))
        self.task = clearml.Task.init(**kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> Any:
        return self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        reporter = self.task.get_logger()
        for key, value in values.items():
            found = number(value)
            if found is None:
                warn_dropped("ClearMLTracker", key, value, "numbers as scalars")
            elif step is None:
                reporter.report_single_value(name=key, value=found, **kwargs)
            else:
                title, series = _title_series(key)
                reporter.report_scalar(title=title, series=series, value=found, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is an image (array or PIL image), reported with ``Logger.report_image``."""
        reporter = self.task.get_logger()
        for key, image in values.items():
            title, series = _title_series(key)
            reporter.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Report a table: ``dataframe``, or ``data`` rows (headed by ``columns`` when given)."""
        table = dataframe
        if table is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs `data` (a list of rows) when `dataframe` is None")
            table = [columns, *data] if columns else data
        title, series = _title_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if not self._initialized_externally:  # a task this process started before init_trackers stays open
            super().finish()
