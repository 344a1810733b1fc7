"""``accelerate.launchers``'s names at Accelerate's path; they live in ``hasten.distributed.launchers``."""

from hasten.distributed.launchers import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
