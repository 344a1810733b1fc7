"""``accelerate.parallelism_config``'s names at Accelerate's path; they live in ``hasten.settings.parallelism``."""

from hasten.settings.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
