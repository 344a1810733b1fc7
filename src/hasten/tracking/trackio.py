"""``TrackioTracker`` (``log_with="trackio"``): a trackio run (local by default: a SQLite file)."""

from __future__ import annotations

import inspect
from typing import Any

from .base import GeneralTracker, on_main_process, require

__all__ = ["TrackioTracker"]


class TrackioTracker(GeneralTracker):
    """Logs to ``trackio.init(project=run_name, **kwargs)``, as Accelerate's.

    ``store_init_configuration`` updates ``trackio.config``; ``log`` is the run's ``log``. Where the
    installed trackio's ``log`` takes a ``step``, the step is passed on (Accelerate's leaves it out,
    so trackio counts the calls instead).
    """

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None
        self._takes_step = False

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def start(self) -> None:
        trackio = require("trackio", "trackio", "TrackioTracker")
        self.run = trackio.init(project=self.run_name, **self.init_kwargs)
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

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
