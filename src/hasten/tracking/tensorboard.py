"""``TensorBoardTracker`` (``log_with="tensorboard"``): event files through ``torch.utils.tensorboard``."""

from __future__ import annotations

import os
from typing import Any

from hasten.tracking.base import RunTracker, on_main_process, require, scalar, warn_dropped

__all__ = ["TensorBoardTracker"]

TAKES = "numbers, one-element tensors, strings and dicts of numbers"


class TensorBoardTracker(RunTracker):
    """Logs to TensorBoard event files in ``logging_dir/run_name`` (``torch.utils.tensorboard``).

    ``log`` writes numbers (and one-element tensors) as scalars, strings as text and dicts of
    numbers as ``add_scalars`` groups, and skips any other value with a warning (once per key and
    type), as Accelerate's skips it; ``store_init_configuration`` writes the hyperparameters
    for TensorBoard's HParams tab. Extra keyword arguments go to ``SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True
    _handle = "writer"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)

    @on_main_process
    def start(self) -> None:
        require("tensorboard", "tracking", "TensorBoardTracker")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        for summary in hparams(plain, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = scalar(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                group = {k: scalar(x) for k, x in value.items()}
                for k in [k for k, x in group.items() if x is None]:
                    warn_dropped("TensorBoardTracker", f"{key}/{k}", value[k], TAKES)
                    del group[k]
                if group:
                    self.writer.add_scalars(key, group, global_step=step, **kwargs)
            else:  # None (diffusers logs ema_decay=None without EMA), lists, images: skipped, as Accelerate's does
                warn_dropped("TensorBoardTracker", key, value, TAKES)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value is a batch of images (N, C, H, W) for ``SummaryWriter.add_images``."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()
