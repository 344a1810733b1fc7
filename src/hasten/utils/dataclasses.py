"""``accelerate.utils.dataclasses``: the kwargs handlers, plugins and enums hasten has.

Their homes: ``hasten.handlers`` (kwargs handlers), ``hasten.options`` (plugins and
configurations), ``hasten.choices`` (hook types, dynamo backends), ``hasten.state``
(``DistributedType``) and ``hasten.tracking`` (``LoggerType``).
"""

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
from ..options import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from ..state import DistributedType
from ..tracking import LoggerType

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
]
