"""``MLflowTracker`` (``log_with="mlflow"``): an MLflow run in the experiment named after the project.

Where the run is stored is MLflow's choice: ``MLFLOW_TRACKING_URI`` (a server, ``sqlite:///...``
or a ``file://`` folder), else MLflow's default. ``logging_dir`` is the experiment's artifact
location when the experiment is created.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hasten.settings import environment as env
from hasten.tracking.base import BuiltInTracker, number, on_main_process, require, warn_dropped

__all__ = ["MLflowTracker"]


def _env_flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class MLflowTracker(BuiltInTracker):
    """Logs to an MLflow run, as Accelerate's ``MLflowTracker``.

    ``experiment_name`` (``init_trackers``' project name), ``run_id`` (resume that run), ``tags``
    (a dict, or its JSON text) and ``nested_run`` give way to ``MLFLOW_EXPERIMENT_NAME``,
    ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` and ``MLFLOW_NESTED_RUN`` when those are set. ``start``
    uses the experiment of that name, creating it (artifacts under ``logging_dir``, with
    ``tags``) if there is none, and starts the run (``run_name``, ``description``, ``tags``).
    ``store_init_configuration`` logs the values as parameters (values longer than MLflow takes
    are left out, with a warning); ``log`` logs numbers and one-element tensors as metrics at
    ``step`` and leaves out anything else, with a warning.
    """

    name = "mlflow"
    requires_logging_directory = False
    _handle = "active_run"

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        tags = env.get(env.MLFLOW_TAGS, tags)
        if isinstance(tags, str):
            try:
                tags = json.loads(tags)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"MLflowTracker.tags (or MLFLOW_TAGS) must be a dict or its JSON text, got {tags!r}"
                ) from error
        if tags is not None and not isinstance(tags, dict):
            raise TypeError(f"MLflowTracker.tags must be a dict of tag -> value, got {tags!r}")
        self.experiment_name = env.get(env.MLFLOW_EXPERIMENT_NAME, experiment_name)
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.run_id = env.get(env.MLFLOW_RUN_ID, run_id)
        self.tags = tags
        self.nested_run = _env_flag(env.get(env.MLFLOW_NESTED_RUN, nested_run))
        self.run_name = run_name
        self.description = description

    @on_main_process
    def start(self) -> None:
        mlflow = require("mlflow", "mlflow", "MLflowTracker")
        experiment = mlflow.get_experiment_by_name(self.experiment_name) if self.experiment_name else None
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif self.experiment_name:
            experiment_id = mlflow.create_experiment(
                name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
            )
        else:
            experiment_id = None  # MLflow's default experiment
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        kept = {}
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:  # MLflow stores parameters as text
                warn_dropped("MLflowTracker", key, value, f"parameters of at most {MAX_PARAM_VAL_LENGTH} characters")
            else:
                kept[key] = value
        items = list(kept.items())
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):  # MLflow takes so many per call
            mlflow.log_params(dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``kwargs`` (``Accelerator.log(log_kwargs={"mlflow": {...}})``) go to ``mlflow.log_metrics``."""
        import mlflow

        metrics = {}
        for key, value in values.items():
            found = number(value)
            if found is None:
                warn_dropped("MLflowTracker", key, value, "numbers as metrics")
            else:
                metrics[key] = found
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib or plotly ``figure`` as the run's artifact ``artifact_file``."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Copy every file of ``local_dir`` into the run's artifacts (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Copy the file ``local_path`` into the run's artifacts (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        if self.active_run is not None:
            mlflow.end_run()
