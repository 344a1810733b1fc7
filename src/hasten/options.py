"""The Accelerator's option dataclasses, with Accelerate's names and fields.

``ProjectConfiguration`` (where checkpoints and logs go). Each is validated when it is
built, so a bad value fails on the user's own line with the field, the value and what is
allowed. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _validate as v

__all__ = ["ProjectConfiguration"]


def _optional_path(owner: str, field: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike) or None, got {value!r}")
    return os.fspath(value)


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs, and how checkpoints are named.

    - ``project_dir``: the run's folder; checkpoints named automatically go to
      ``project_dir/checkpoints/checkpoint_N``.
    - ``logging_dir``: where trackers that write files (TensorBoard) log; defaults to ``project_dir``.
    - ``automatic_checkpoint_naming``: ``save_state()`` always names the checkpoint itself
      (an ``output_dir`` passed to it is ignored, with a warning), as in Accelerate. Without it,
      ``save_state()`` with no ``output_dir`` names it too (hasten's default).
    - ``total_limit``: keep only the newest N automatically named checkpoints.
    - ``iteration``: the N of the next automatically named checkpoint (at least one more than
      the largest existing N, so nothing is overwritten); counts up after each save.
    - ``save_on_each_node``: ``save()`` and ``save_model()`` write on the local main process
      of every machine (for machines without a shared filesystem).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        owner = "ProjectConfiguration"
        self.project_dir = _optional_path(owner, "project_dir", self.project_dir)
        self.logging_dir = _optional_path(owner, "logging_dir", self.logging_dir)
        v.check_bool(owner, "automatic_checkpoint_naming", self.automatic_checkpoint_naming)
        if self.total_limit is not None:
            v.check_number(owner, "total_limit", self.total_limit, integer=True, ge=1)
        v.check_number(owner, "iteration", self.iteration, integer=True, ge=0)
        v.check_bool(owner, "save_on_each_node", self.save_on_each_node)
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when no logging directory was given."""
        self.project_dir = _optional_path("ProjectConfiguration", "project_dir", project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


def project_configuration(project_dir: Any, project_config: Any) -> ProjectConfiguration:
    """The Accelerator's ProjectConfiguration from its ``project_dir`` and ``project_config`` arguments."""
    if project_config is None:
        if project_dir is not None and not isinstance(project_dir, (str, os.PathLike)):
            raise TypeError(f"Accelerator.project_dir must be a path (str or os.PathLike) or None, got {project_dir!r}")
        return ProjectConfiguration(project_dir=project_dir)
    if not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"Accelerator.project_config must be a ProjectConfiguration or None, got {project_config!r}")
    if project_dir is not None:
        given = _optional_path("Accelerator", "project_dir", project_dir)
        if project_config.project_dir is None:
            project_config.set_directories(given)
        elif os.path.abspath(given) != os.path.abspath(project_config.project_dir):
            raise ValueError(
                f"Accelerator(project_dir={given!r}) conflicts with ProjectConfiguration(project_dir="
                f"{project_config.project_dir!r}); give the project directory once"
            )
    return project_config
