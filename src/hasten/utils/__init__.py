"""Compatibility re-exports, so ``from hasten.utils import ProfileKwargs`` works as in Accelerate.

The submodules are Accelerate's (``dataclasses``, ``operations``, ``memory``, ``random``,
``other``, ``imports``), each with the names of Accelerate's that hasten has.
"""

from __future__ import annotations

import importlib
from typing import Any

from hasten.settings.parallelism import ParallelismConfig
from hasten.tracking import GeneralTracker
from hasten.utils import dataclasses, memory, operations, random
from hasten.utils.dataclasses import *  # noqa: F403 - each submodule's __all__, as in Accelerate's utils
from hasten.utils.memory import *  # noqa: F403
from hasten.utils.operations import *  # noqa: F403
from hasten.utils.random import *  # noqa: F403

_EAGER = [*dataclasses.__all__, *memory.__all__, *operations.__all__, *random.__all__]

# Loaded on first use, as in ``hasten`` itself.
_LAZY = {
    "check_os_kernel": "hasten.utils.other",
    "debug_launcher": "hasten.distributed.launchers",
    "notebook_launcher": "hasten.distributed.launchers",
    "skip_first_batches": "hasten.compat.data_loader",
    # Accelerate's global state: hasten's runtime imports hasten.utils.other, never these.
    "AcceleratorState": "hasten.compat.state",
    "GradientState": "hasten.compat.state",
    "PartialState": "hasten.compat.state",
}
_IMPORTS_MODULE = "hasten.utils.imports"  # the is_*_available helpers
_LAZY.update(dict.fromkeys(importlib.import_module(_IMPORTS_MODULE).__all__, _IMPORTS_MODULE))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [*_LAZY, *_EAGER, "ParallelismConfig", "GeneralTracker"]


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
