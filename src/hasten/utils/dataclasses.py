"""``accelerate.utils.dataclasses``: the kwargs handlers, plugins and enums hasten has.

Their homes: ``hasten.settings.handlers`` (kwargs handlers), ``hasten.settings.recipes`` (the fp8
recipe handlers), ``hasten.settings.plugins`` (plugins and configurations), ``hasten.settings.parallelism``
(the tensor/context-parallel handlers), ``hasten.settings.choices`` (hook types, dynamo backends, fp8
backends), ``hasten.distributed.state`` (``DistributedType``) and ``hasten.tracking`` (``LoggerType``).
"""

from __future__ import annotations

from hasten.distributed.state import DistributedType
from hasten.settings.choices import DDPCommunicationHookType, DynamoBackend, FP8BackendType
from hasten.settings.handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from hasten.settings.parallelism import TorchContextParallelConfig, TorchTensorParallelConfig
from hasten.settings.pipeline import TorchPipelineParallelConfig
from hasten.settings.plugins import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from hasten.settings.recipes import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from hasten.tracking import LoggerType

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FP8BackendType",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MSAMPRecipeKwargs",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TERecipeKwargs",
    "TorchDynamoPlugin",
    "TorchContextParallelConfig",
    "TorchPipelineParallelConfig",
    "TorchTensorParallelConfig",
]
