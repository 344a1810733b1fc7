"""``SwanLabTracker`` (``log_with="swanlab"``): a SwanLab run (``mode="offline"`` or ``"local"`` keeps it here)."""

from __future__ import annotations

from typing import Any

from hasten.tracking.base import ProjectRunTracker, on_main_process

__all__ = ["SwanLabTracker"]


class SwanLabTracker(ProjectRunTracker):
    """Logs to ``swanlab.init(project=run_name, **kwargs)``, as Accelerate's.

    ``store_init_configuration`` updates ``swanlab.config``; ``log`` is the run's ``log`` at ``step``.
    (Accelerate also writes ``FRAMEWORK: 🤗Accelerate`` into the config; hasten adds nothing.)
    """

    name = "swanlab"
    package = "swanlab"

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import swanlab

        swanlab.config.update(values)  # a plain update: Accelerate's allow_val_change=True is stored as a key

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is a list of images (arrays or PIL images), logged as ``swanlab.Image``."""
        import swanlab

        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)
