"""``accelerate.utils.memory``: the names hasten has (homed in ``hasten.training.memory``).

``clear_device_cache`` and ``should_reduce_batch_size`` (Accelerate 1.16's, which transformers'
Trainer imports from here) are not exported by ``hasten.utils`` itself, as in Accelerate.
"""

from __future__ import annotations

import gc

from hasten.training.memory import find_executable_batch_size, is_out_of_memory, release_memory

__all__ = ["find_executable_batch_size", "release_memory"]


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Empty the accelerator's memory cache (``torch.<backend>.empty_cache()``), after a
    ``gc.collect()`` with ``garbage_collection`` (slow: use sparingly); nothing on the CPU or on HPU."""
    from hasten.utils.imports import get_torch_accelerator_backend

    if garbage_collection:
        gc.collect()
    device_type, device_module = get_torch_accelerator_backend()
    if device_type in (None, "hpu"):  # HPU reserves all its memory for the process
        return
    if hasattr(device_module, "empty_cache"):
        device_module.empty_cache()


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether ``exception`` is running out of memory (CUDA, XPU, MPS, HPU, the CPU's allocator) or
    cuDNN refusing the shapes: a reason to retry with a smaller batch (Accelerate's test)."""
    return is_out_of_memory(exception)
