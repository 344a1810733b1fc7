"""``accelerate.state``'s names at Accelerate's path; they live in ``hasten.compat.state``,
``hasten.distributed.state``."""

from hasten.compat.state import AcceleratorState, GradientState, PartialState
from hasten.distributed import state as _runtime
from hasten.distributed.state import DistributedType

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState", "is_initialized"]


def is_initialized() -> bool:
    """Whether an Accelerator's state exists (one was made since the last ``_reset_state()``), as
    Accelerate's ``accelerate.state.is_initialized()``."""
    return _runtime._current.get("state") is not None
