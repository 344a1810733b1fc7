"""hasten: one PyTorch training loop on one CPU, one GPU or many processes.

Public names match Hugging Face Accelerate's top level. They are loaded on first use, so
``import hasten`` stays cheap and the CLI can start without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hasten import _quiet
from hasten._version import __version__

# torchao's known import-time lines (transformers imports it) kept off the console, on every worker of
# `hasten launch` too (it imports hasten before the script): hasten/_quiet.py says which and why
_quiet.install()

_EXPORTS = {
    "Accelerator": "hasten.accelerator",
    "PartialState": "hasten.compat.state",
    "DistributedType": "hasten.distributed.state",
    "AcceleratorState": "hasten.compat.state",
    "GradientState": "hasten.compat.state",
    "debug_launcher": "hasten.distributed.launchers",
    "notebook_launcher": "hasten.distributed.launchers",
    "skip_first_batches": "hasten.compat.data_loader",
    "KwargsHandler": "hasten.settings.handlers",
    "AutocastKwargs": "hasten.settings.handlers",
    "DistributedDataParallelKwargs": "hasten.settings.handlers",
    "GradScalerKwargs": "hasten.settings.handlers",
    "InitProcessGroupKwargs": "hasten.settings.handlers",
    "ProfileKwargs": "hasten.settings.handlers",
    "FaultToleranceKwargs": "hasten.settings.fault_tolerance",
    "AORecipeKwargs": "hasten.settings.recipes",
    "TERecipeKwargs": "hasten.settings.recipes",
    "MSAMPRecipeKwargs": "hasten.settings.recipes",
    "FP8RecipeKwargs": "hasten.settings.recipes",
    "DDPCommunicationHookType": "hasten.settings.choices",
    "ProjectConfiguration": "hasten.settings.plugins",
    "GradientAccumulationPlugin": "hasten.settings.plugins",
    "DataLoaderConfiguration": "hasten.settings.plugins",
    "TorchDynamoPlugin": "hasten.settings.plugins",
    "DynamoBackend": "hasten.settings.choices",
    "FullyShardedDataParallelPlugin": "hasten.settings.plugins",
    "ParallelismConfig": "hasten.settings.parallelism",
    "GeneralTracker": "hasten.tracking",
    "LoggerType": "hasten.tracking",
    "cpu_offload": "hasten.big_modeling",
    "cpu_offload_with_hook": "hasten.big_modeling",
    "disk_offload": "hasten.big_modeling",
    "dispatch_model": "hasten.big_modeling",
    "load_checkpoint_and_dispatch": "hasten.big_modeling",
    "infer_auto_device_map": "hasten.utils.modeling",
    "load_checkpoint_in_model": "hasten.utils.modeling",
    "install_as_accelerate": "hasten.compat.as_accelerate",
    "init_empty_weights": "hasten.big_modeling",
    "init_on_device": "hasten.big_modeling",
    "find_executable_batch_size": "hasten.training.memory",
    "synchronize_rng_states": "hasten.training.rng",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from hasten.accelerator import Accelerator
    from hasten.big_modeling import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
    )
    from hasten.compat.as_accelerate import install_as_accelerate
    from hasten.compat.data_loader import skip_first_batches
    from hasten.compat.state import AcceleratorState, GradientState, PartialState
    from hasten.distributed.launchers import debug_launcher, notebook_launcher
    from hasten.distributed.state import DistributedType
    from hasten.settings.choices import DDPCommunicationHookType, DynamoBackend
    from hasten.settings.fault_tolerance import FaultToleranceKwargs
    from hasten.settings.handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        ProfileKwargs,
    )
    from hasten.settings.parallelism import ParallelismConfig
    from hasten.settings.plugins import (
        DataLoaderConfiguration,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        ProjectConfiguration,
        TorchDynamoPlugin,
    )
    from hasten.settings.recipes import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
    from hasten.tracking import GeneralTracker, LoggerType
    from hasten.training.memory import find_executable_batch_size
    from hasten.training.rng import synchronize_rng_states
    from hasten.utils.modeling import infer_auto_device_map, load_checkpoint_in_model


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
