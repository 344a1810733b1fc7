"""``CometMLTracker`` (``log_with="comet_ml"``): a Comet experiment in the project named after the run.

``comet_ml.start`` decides online or offline: ``COMET_START_ONLINE=false`` (or
``init_kwargs={"comet_ml": {"online": False}}``) writes the experiment as a zip under
``COMET_OFFLINE_DIRECTORY`` for a later ``comet upload``.
"""

from __future__ import annotations

from typing import Any

from hasten.tracking.base import RunTracker, number, on_main_process, require

__all__ = ["CometMLTracker"]


class CometMLTracker(RunTracker):
    """Logs to a Comet experiment, ``comet_ml.start(project_name=run_name, **kwargs)``, as Accelerate's.

    (comet_ml older than 3.41 has no ``start``: then ``comet_ml.Experiment(project_name=..., **kwargs)``.)
    ``store_init_configuration`` logs parameters; ``log`` sets the step, then logs numbers (and
    one-element tensors) as metrics, strings as "others" and dicts of numbers as metrics.
    """

    name = "comet_ml"
    requires_logging_directory = False
    _handle = "writer"
    _closer = "end"

    @on_main_process
    def start(self) -> None:
        comet_ml = require("comet_ml", "comet_ml", "CometMLTracker")
        begin = getattr(comet_ml, "start", None) or comet_ml.Experiment
        self.writer = begin(project_name=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            found = number(value)
            if found is not None:
                self.writer.log_metric(key, found, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
