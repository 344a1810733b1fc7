"""``accelerate.optimizer``'s names at Accelerate's path; they live in ``hasten.training.optimizer``."""

from hasten.training.optimizer import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
