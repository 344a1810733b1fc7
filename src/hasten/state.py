"""``accelerate.state``'s names at Accelerate's path; they live in ``hasten.compat.state``,
``hasten.distributed.state``."""

from hasten.compat.state import AcceleratorState, GradientState, PartialState
from hasten.distributed.state import DistributedType

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
