"""hasten: one PyTorch training loop on one CPU, one GPU or many processes.

Public names match Hugging Face Accelerate's top level. They are loaded on first use, so
``import hasten`` stays cheap and the CLI can start without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_EXPORTS = {
    "Accelerator": "hasten.accelerator",
    "PartialState": "hasten.compat.state",
    "DistributedType": "hasten.state",
    "AcceleratorState": "hasten.compat.state",
    "GradientState": "hasten.compat.state",
    "debug_launcher": "hasten.launchers",
    "notebook_launcher": "hasten.launchers",
    "skip_first_batches": "hasten.compat.data_loader",
    "KwargsHandler": "hasten.handlers",
    "AutocastKwargs": "hasten.handlers",
    "DistributedDataParallelKwargs": "hasten.handlers",
    "GradScalerKwargs": "hasten.handlers",
    "InitProcessGroupKwargs": "hasten.handlers",
    "ProfileKwargs": "hasten.handlers",
    "DDPCommunicationHookType": "hasten.choices",
    "ProjectConfiguration": "hasten.options",
    "GradientAccumulationPlugin": "hasten.options",
    "DataLoaderConfiguration": "hasten.options",
    "TorchDynamoPlugin": "hasten.options",
    "DynamoBackend": "hasten.choices",
    "FullyShardedDataParallelPlugin": "hasten.options",
    "ParallelismConfig": "hasten.parallelism_config",
    "GeneralTracker": "hasten.tracking",
    "LoggerType": "hasten.tracking",
    "init_empty_weights": "hasten.big_modeling",
    "init_on_device": "hasten.big_modeling",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator
    from .choices import DDPCommunicationHookType, DynamoBackend
    from .handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        ProfileKwargs,
    )
    from .options import (
        DataLoaderConfiguration,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        ProjectConfiguration,
        TorchDynamoPlugin,
    )
    from .parallelism_config import ParallelismConfig
    from .compat.data_loader import skip_first_batches
    from .launchers import debug_launcher, notebook_launcher
    from .compat.state import AcceleratorState, GradientState, PartialState
    from .state import DistributedType
    from .tracking import GeneralTracker, LoggerType
    from .big_modeling import init_empty_weights, init_on_device


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
