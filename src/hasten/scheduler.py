"""``accelerate.scheduler``'s names at Accelerate's path; they live in ``hasten.training.scheduler``."""

from hasten.training.scheduler import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
