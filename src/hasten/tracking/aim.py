"""``AimTracker`` (``log_with="aim"``): an Aim run in the repository at the logging directory."""

from __future__ import annotations

import os
from typing import Any

from hasten.tracking.base import RunTracker, on_main_process, require

__all__ = ["AimTracker"]


class AimTracker(RunTracker):
    """Logs to an Aim ``Run(repo=logging_dir, **kwargs)`` named ``run_name``, as Accelerate's.

    ``store_init_configuration`` sets the run's ``"hparams"``; ``log`` tracks each value under its
    key at ``step`` (keyword arguments go to ``Run.track``).
    """

    name = "aim"
    requires_logging_directory = True
    _handle = "writer"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.aim_repo_path = logging_dir

    @on_main_process
    def start(self) -> None:
        aim = require("aim", "aim", "AimTracker")
        repo = None if self.aim_repo_path is None else os.fspath(self.aim_repo_path)
        self.writer = aim.Run(repo=repo, **self.init_kwargs)
        self.writer.name = self.run_name

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(
        self, values: dict[str, Any], step: int | None = None, kwargs: dict[str, dict] | None = None
    ) -> None:
        """Each value is an image (array or PIL image) or an ``(image, caption)`` pair.

        ``kwargs={"aim_image": {...}, "track": {...}}`` go to ``aim.Image`` and ``Run.track``.
        """
        import aim

        image_kwargs = (kwargs or {}).get("aim_image", {})
        track_kwargs = (kwargs or {}).get("track", {})
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption=caption, **image_kwargs), name=key, step=step, **track_kwargs)
