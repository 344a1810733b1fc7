"""``SwanLabTracker`` (``log_with="swanlab"``): a SwanLab run (``mode="offline"`` or ``"local"`` keeps it here)."""

from __future__ import annotations

from typing import Any

from .base import GeneralTracker, on_main_process, require

__all__ = ["SwanLabTracker"]


class SwanLabTracker(GeneralTracker):
    """Logs to ``swanlab.init(project=run_name, **kwargs)``, as Accelerate's.

    ``store_init_configuration`` updates ``swanlab.config``; ``log`` is the run's ``log`` at ``step``.
    (Accelerate also writes ``FRAMEWORK: 🤗Accelerate`` into the config; hasten adds nothing.)
    """

    name = "swanlab"
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
        swanlab = require("swanlab", "swanlab", "SwanLabTracker")
        self.run = swanlab.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import swanlab

        swanlab.config.update(values)  # a plain update: Accelerate's allow_val_change=True is stored as a key

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is a list of images (arrays or PIL images), logged as ``swanlab.Image``."""
        import swanlab

        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
