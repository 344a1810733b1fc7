"""``accelerate.utils.memory``: the names hasten has (homed in ``hasten.training.memory``)."""

from __future__ import annotations

from hasten.training.memory import find_executable_batch_size, release_memory

__all__ = ["find_executable_batch_size", "release_memory"]
