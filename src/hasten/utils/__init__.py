"""Compatibility re-exports, so ``from hasten.utils import ProfileKwargs`` works as in Accelerate.

The submodules are Accelerate's (``dataclasses``, ``operations``, ``memory``, ``random``,
``other``, ``imports``), each with the names of Accelerate's that hasten has.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..state import AcceleratorState, GradientState, PartialState
from ..tracking import GeneralTracker
from .dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .memory import find_executable_batch_size, release_memory
from .operations import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from .random import set_seed, synchronize_rng_states

# Loaded on first use, as in ``hasten`` itself.
_LAZY = {
    "check_os_kernel": "hasten.utils.other",
    "debug_launcher": "hasten.launchers",
    "notebook_launcher": "hasten.launchers",
    "skip_first_batches": "hasten.data_loader",
}
_IMPORTS_MODULE = "hasten.utils.imports"  # the is_*_available helpers
_LAZY.update(dict.fromkeys(importlib.import_module(_IMPORTS_MODULE).__all__, _IMPORTS_MODULE))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    *_LAZY,
    "AcceleratorState",
    "GradientState",
    "PartialState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "find_executable_batch_size",
    "release_memory",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_states",
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
]


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
