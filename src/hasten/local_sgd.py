"""``accelerate.local_sgd``'s names at Accelerate's path; they live in ``hasten.training.local_sgd``."""

from hasten.training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
