"""``TrackioTracker`` (``log_with="trackio"``): a trackio run (local by default: a SQLite file)."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from hasten.tracking.base import ProjectRunTracker, on_main_process

__all__ = ["TrackioTracker"]


class TrackioTracker(ProjectRunTracker):
    """Logs to ``trackio.init(project=run_name, **kwargs)``, as Accelerate's.

    ``store_init_configuration`` updates ``trackio.config``; ``log`` is the run's ``log``. Where the
    installed trackio's ``log`` takes a ``step``, the step is passed on (Accelerate's leaves it out,
    so trackio counts the calls instead).
    """

    name = "trackio"
    package = "trackio"
    _takes_step = False

    def started(self, module: ModuleType) -> None:
        try:
            self._takes_step = "step" in inspect.signature(self.run.log).parameters
        except (TypeError, ValueError):  # not introspectable
            self._takes_step = False

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import trackio

        trackio.config.update(values)  # a plain update: Accelerate's allow_val_change=True is stored as a key

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None and self._takes_step:
            kwargs.setdefault("step", step)
        self.run.log(values, **kwargs)
