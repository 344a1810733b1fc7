"""``WandBTracker`` (``log_with="wandb"``): a Weights & Biases run."""

from __future__ import annotations

from typing import Any

from hasten.tracking.base import ProjectRunTracker, on_main_process

__all__ = ["WandBTracker"]


class WandBTracker(ProjectRunTracker):
    """Logs to a Weights & Biases run, ``wandb.init(project=run_name, **kwargs)``.

    Offline runs (``WANDB_MODE=offline``) write under ``./wandb`` or ``dir=...``.
    """

    name = "wandb"
    package = "wandb"

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

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
