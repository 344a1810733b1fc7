"""``DVCLiveTracker`` (``log_with="dvclive"``): a ``dvclive.Live`` logger (files under its ``dir``)."""

from __future__ import annotations

from typing import Any

from hasten.tracking.base import BuiltInTracker, number, on_main_process, require, warn_dropped

__all__ = ["DVCLiveTracker"]


class DVCLiveTracker(BuiltInTracker):
    """Logs to ``live`` or a new ``dvclive.Live(**kwargs)``, as Accelerate's (``run_name`` is not used).

    ``store_init_configuration`` logs parameters; ``log`` sets ``live.step`` to ``step`` when one is
    given, logs every value ``Live.log_metric`` takes (numbers, strings; one-element tensors as
    their number; others are left out, with a warning) and then moves to the next step.
    """

    name = "dvclive"
    requires_logging_directory = False
    _handle = "live"
    _closer = "end"

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        if self.live is None:
            dvclive = require("dvclive", "dvclive", "DVCLiveTracker")
            self.live = dvclive.Live(**self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            found = number(value)  # one-element tensors too
            value = value if found is None else found
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                warn_dropped("DVCLiveTracker", key, value, "what Live.log_metric takes")
        self.live.next_step()
