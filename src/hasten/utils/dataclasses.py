"""``accelerate.utils.dataclasses``: the kwargs handlers, plugins and enums hasten has.

Their homes: ``hasten.settings.handlers`` (kwargs handlers), ``hasten.settings.recipes`` (the fp8
recipe handlers), ``hasten.settings.plugins`` (plugins and configurations), ``hasten.settings.parallelism``
(the tensor/context-parallel handlers), ``hasten.settings.choices`` (hook types, dynamo backends, fp8
backends), ``hasten.distributed.state`` (``DistributedType``) and ``hasten.tracking`` (``LoggerType``).

``TorchTensorParallelPlugin`` (Accelerate's older tensor-parallel plugin) is defined here: it can
be built, and ``Accelerator(torch_tp_plugin=...)`` is refused (``hasten.settings.resolve``),
naming ``ParallelismConfig(tp_size=...)``. Accelerate's plain enums and ``TensorInformation`` are
defined here: ``PrecisionType``, ``RNGType``, ``ComputeEnvironment``, ``CustomDtype`` and
``SageMakerDistributedType``.
hasten's ``mixed_precision`` and ``synchronize_rng_states`` take their members as well as the strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from hasten.distributed.state import DistributedType
from hasten.settings.choices import (
    DDPCommunicationHookType,
    DynamoBackend,
    FP8BackendType,
    StrEnum,
    _ValueContainsMeta,
)
from hasten.settings.expert_parallel import TorchExpertParallelConfig
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
from hasten.utils.deepspeed import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig  # refused at Accelerator(...)

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
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
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TensorInformation",
    "TorchDynamoPlugin",
    "TorchContextParallelConfig",
    "TorchTensorParallelPlugin",
    "TorchPipelineParallelConfig",
    "TorchExpertParallelConfig",
    "TorchTensorParallelConfig",
]


class _ListedStrEnum(StrEnum, metaclass=_ValueContainsMeta):
    """Accelerate's ``BaseEnum`` on ``str``: ``str(member)`` is its value, ``"fp16" in Enum`` tests
    the values, and ``Enum.list()`` gives every value."""

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class _ListedEnum(enum.Enum, metaclass=_ValueContainsMeta):
    """Accelerate's ``BaseEnum`` (not a ``str``): members print as their values, ``Enum.list()``."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class PrecisionType(_ListedStrEnum):
    """The ``mixed_precision`` values: ``NO`` (float32), ``FP8``, ``FP16``, ``BF16``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_ListedEnum):
    """The random generators ``synchronize_rng_states`` can share. hasten synchronizes ``TORCH``,
    ``CUDA`` and ``GENERATOR``; the other devices' generators are refused, naming the device."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class ComputeEnvironment(str, enum.Enum):
    """Where a config file's run happens: ``LOCAL_MACHINE`` (hasten's only one) or ``AMAZON_SAGEMAKER``."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """Accelerate's SageMaker parallelism kinds (hasten does not launch on SageMaker)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class CustomDtype(enum.Enum):
    """Sizes below one byte per value that Accelerate's memory estimates count: ``FP8``, ``INT4``, ``INT2``."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


@dataclass
class TensorInformation:
    """A tensor's shape and dtype, what ``get_data_structure`` records and ``initialize_tensors`` rebuilds."""

    shape: torch.Size
    dtype: torch.dtype


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's tensor-parallel plugin (``tp_size``, ``torch_device_mesh``), with its fields
    and defaults. It can be built; ``Accelerator(torch_tp_plugin=...)`` is refused: hasten's tensor
    parallelism is ``ParallelismConfig(tp_size=..., tp_plan=...)`` (as in Accelerate 1.15, where
    this plugin gave way to it)."""

    tp_size: int = 1
    torch_device_mesh: Any = None


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
    """The class named ``name`` of ``module`` or of its first submodule (depth first) of that
    class name, None if there is none (Accelerate's; PEFT and FSDP wrap policies call it)."""
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None
