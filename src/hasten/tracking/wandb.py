"""``WandBTracker`` (``log_with="wandb"``): a Weights & Biases run."""

from __future__ import annotations

from typing import Any

from .base import GeneralTracker, on_main_process, require

__all__ = ["WandBTracker"]


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
        wandb = require("wandb", "wandb", "WandBTracker")
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
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a ``wandb.Table`` built from ``columns`` and ``data`` (rows), or from ``dataframe``."""
        import wandb

        self.run.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
