"""Compatibility re-exports, so ``from hasten.utils import ProfileKwargs`` works as in Accelerate."""

from __future__ import annotations

from ..choices import DDPCommunicationHookType, DynamoBackend
from ..handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from ..ops import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from ..memory import find_executable_batch_size, release_memory
from ..options import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from ..rng import set_seed
from ..state import DistributedType
from ..tracking import GeneralTracker, LoggerType

__all__ = [
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
]
