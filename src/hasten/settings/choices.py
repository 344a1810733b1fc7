"""The one typed source of every closed set of choices in hasten.

Pure Python (no torch import), so the CLI can build its ``choices=`` from here
without paying for torch at start-up.
"""

from __future__ import annotations

from enum import Enum, EnumMeta
from typing import Literal, get_args

MixedPrecision = Literal["no", "fp16", "bf16", "fp8"]
MIXED_PRECISION_CHOICES: tuple[str, ...] = get_args(MixedPrecision)

# The fp8 recipe handlers' closed fields (Accelerate's Literals): Transformer Engine's formats and
# scaling-factor algorithms, MS-AMP's optimisation levels, and the backends FP8RecipeKwargs names.
FP8Format = Literal["HYBRID", "E4M3", "E5M2"]
FP8_FORMATS: tuple[str, ...] = get_args(FP8Format)
AmaxComputeAlgorithm = Literal["max", "most_recent"]
AMAX_COMPUTE_ALGOS: tuple[str, ...] = get_args(AmaxComputeAlgorithm)
OptLevel = Literal["O1", "O2"]
OPT_LEVELS: tuple[str, ...] = get_args(OptLevel)
FP8RecipeBackend = Literal["TE", "MSAMP"]
FP8_RECIPE_BACKENDS: tuple[str, ...] = get_args(FP8RecipeBackend)

ProfilerActivityName = Literal["cpu", "cuda", "xpu", "mtia", "hpu"]
PROFILER_ACTIVITIES: tuple[str, ...] = get_args(ProfilerActivityName)

ScheduleKey = Literal["wait", "warmup", "active", "repeat", "skip_first"]
SCHEDULE_KEYS: tuple[str, ...] = get_args(ScheduleKey)

# Accelerate's reductions ("none" sums too, as in Accelerate: it only skips the averaging),
# plus min and product, which torch.distributed offers.
ReduceOp = Literal["sum", "mean", "max", "min", "product", "none"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)

RdzvBackend = Literal["static", "c10d"]
RDZV_BACKENDS: tuple[str, ...] = get_args(RdzvBackend)

DynamoMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
DYNAMO_MODES: tuple[str, ...] = get_args(DynamoMode)


class StrEnum(str, Enum):
    """A ``str`` enum whose members print as their values (``str(member) == member.value``), as
    Accelerate's enums do (Python 3.10 has no ``enum.StrEnum``)."""

    def __str__(self) -> str:
        return self.value


class _ValueContainsMeta(EnumMeta):
    """``"fp16" in DDPCommunicationHookType`` is True: membership by value too."""

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, cls):
            return True
        return isinstance(item, str) and item in cls._value2member_map_


class DDPCommunicationHookType(StrEnum, metaclass=_ValueContainsMeta):
    """Gradient communication hooks for DistributedDataParallel.

    A ``str`` enum: members compare equal to their values and ``str(member)`` is the
    value, so plain strings are accepted wherever a member is.
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


COMM_HOOKS: tuple[str, ...] = tuple(m.value for m in DDPCommunicationHookType)
COMM_WRAPPERS: tuple[str, ...] = ("no", "fp16", "bf16")
POWER_SGD_HOOKS: tuple[str, ...] = ("power_sgd", "batched_power_sgd")


class DynamoBackend(StrEnum, metaclass=_ValueContainsMeta):
    """Accelerate's names of torch.compile backends (any backend torch has registered works too).

    ``TorchDynamoPlugin`` keeps the backend as the lower-case name torch uses.
    """

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class FP8BackendType(StrEnum, metaclass=_ValueContainsMeta):
    """The library that trains in fp8 (Accelerate's ``accelerate.utils.dataclasses.FP8BackendType``).

    ``AO``: torchao, ``TE``: Transformer Engine, ``MSAMP``: MS-AMP, ``NO``: none chosen yet (with
    ``mixed_precision="fp8"`` the Accelerator picks an installed one).
    """

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


FP8_BACKENDS: tuple[str, ...] = tuple(m.value for m in FP8BackendType)


def format_choices(choices: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(c) for c in choices)
