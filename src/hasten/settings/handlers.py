"""The kwargs handlers: small dataclasses that customise how hasten builds torch objects.

Each handler validates its fields at construction (so a bad value fails on the user's own
line) and knows how to turn itself into the torch object it configures. Importing this
module does not import torch; the translations import what they need when called.

Where each translation is consumed (one consumer each):

=============================  =====================================  ==================
handler                        translation                            consumer
=============================  =====================================  ==================
AutocastKwargs                 ``autocast_kwargs(device_type, dtype)``  precision.py
GradScalerKwargs               ``build(device_type, sharded)``        precision.py
DistributedDataParallelKwargs  ``constructor_kwargs()``,              strategies/ddp.py
                               ``register_comm_hook(model)``
ProfileKwargs                  ``build()``                            profiling.py
InitProcessGroupKwargs         ``process_group_kwargs(device_type)``  state.py
=============================  =====================================  ==================

The fp8 recipe handlers (AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs, FP8RecipeKwargs)
are KwargsHandlers too; they live in :mod:`hasten.settings.recipes`. FaultToleranceKwargs lives in
:mod:`hasten.settings.fault_tolerance`; its ``manager_kwargs()`` is consumed by strategies/fault_tolerance.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hasten import _validate as v
from hasten.settings import locations
from hasten.settings.choices import (
    COMM_HOOKS,
    COMM_WRAPPERS,
    POWER_SGD_HOOKS,
    PROFILER_ACTIVITIES,
    SCHEDULE_KEYS,
    DDPCommunicationHookType,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Limits of the torch types these values end up in: beyond them a value is accepted here but
# fails (or silently breaks) later, inside torch.
FLOAT32_MAX = 3.4028234663852886e38  # the GradScaler keeps its scale as a float32 tensor
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it a scale rounds towards 0
FLOAT32_ABOVE_ONE = 1 + 2.0**-23  # the float32 next to 1.0, above and below
FLOAT32_BELOW_ONE = 1 - 2.0**-24
INT64_MAX = 2**63 - 1  # C++ int64 arguments (growth interval, DDP bucket size in bytes)
MAX_TIMEOUT = timedelta(days=36500)  # longer timeouts overflow the store's deadline in nanoseconds
MIN_TIMEOUT = timedelta(milliseconds=1)  # torch's stores count whole milliseconds: less truncates to 0

__all__ = [
    "KwargsHandler",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
]


class KwargsHandler:
    """Mixin for dataclass handlers.

    ``to_dict()`` gives every field; ``to_kwargs()`` only the fields whose value differs
    from a default instance of the same class (so a user's own ``@dataclass`` subclass
    works too).
    """

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__().to_dict()
        return {k: val for k, val in self.to_dict().items() if default[k] != val}


# --------------------------------------------------------------------------- autocast


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast``: whether it is on, and whether it caches casts."""

    enabled: bool = True
    cache_enabled: bool | None = None

    def __post_init__(self) -> None:
        v.check_bool("AutocastKwargs", "enabled", self.enabled)
        v.check_optional_bool("AutocastKwargs", "cache_enabled", self.cache_enabled)

    def autocast_kwargs(self, device_type: str, dtype: torch.dtype) -> dict[str, Any]:
        """The keyword arguments of ``torch.autocast`` for this device and dtype."""
        kwargs: dict[str, Any] = {"device_type": device_type, "dtype": dtype, "enabled": self.enabled}
        if self.cache_enabled is not None:
            kwargs["cache_enabled"] = self.cache_enabled
        return kwargs


# --------------------------------------------------------------------------- grad scaler


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (used with fp16 mixed precision only)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        o = "GradScalerKwargs"
        v.check_number(o, "init_scale", self.init_scale, gt=0)
        v.check_number(o, "init_scale", self.init_scale, ge=FLOAT32_TINY, le=FLOAT32_MAX)  # a float32 tensor
        v.check_number(o, "growth_factor", self.growth_factor, gt=1)
        v.check_number(o, "growth_factor", self.growth_factor, le=FLOAT32_MAX)  # or the scale becomes inf
        v.check_number(o, "backoff_factor", self.backoff_factor, gt=0, lt=1)
        # The scale is a float32 tensor: a factor that rounds to 1.0 there never changes it.
        if v.float32(self.growth_factor) <= 1:
            raise ValueError(
                f"{o}.growth_factor must be > 1 in float32 (the scale is a float32 tensor; the smallest such "
                f"factor is {FLOAT32_ABOVE_ONE!r}), got {self.growth_factor!r}, which is 1.0 in float32"
            )
        if v.float32(self.backoff_factor) >= 1:
            raise ValueError(
                f"{o}.backoff_factor must be < 1 in float32 (the scale is a float32 tensor; the largest such "
                f"factor is {FLOAT32_BELOW_ONE!r}), got {self.backoff_factor!r}, which is 1.0 in float32"
            )
        v.check_number(o, "backoff_factor", self.backoff_factor, ge=FLOAT32_TINY)  # or the scale drops to 0
        v.check_number(o, "growth_interval", self.growth_interval, integer=True, ge=1)
        v.check_number(o, "growth_interval", self.growth_interval, integer=True, le=INT64_MAX)
        v.check_bool(o, "enabled", self.enabled)

    def build(self, device_type: str, sharded: bool = False) -> torch.amp.GradScaler:
        """The ``GradScaler``; ``sharded``: FSDP's ``ShardedGradScaler`` (its inf/nan check agrees
        on every process, each of which sees only its shards)."""
        import torch

        kwargs = self.to_dict()
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            kwargs[name] = float(kwargs[name])  # a huge int such as 2**64 is fine as a float
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device_type, **kwargs)
        return torch.amp.GradScaler(device_type, **kwargs)


# --------------------------------------------------------------------------- DDP

# PowerSGDState's constructor options and the types they take.
POWER_SGD_OPTIONS: dict[str, tuple[type, ...]] = {
    "matrix_approximation_rank": (int,),
    "start_powerSGD_iter": (int,),
    "min_compression_rate": (int, float),
    "use_error_feedback": (bool,),
    "warm_start": (bool,),
    "orthogonalization_epsilon": (int, float),
    "random_seed": (int,),
    "compression_stats_logging_frequency": (int,),
    "batch_tensors_with_same_shape": (bool,),
}

_DDP_COMM_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """How a model is wrapped in ``torch.nn.parallel.DistributedDataParallel``.

    The first seven fields are DDP's own constructor arguments. ``comm_hook`` picks a
    gradient communication hook, ``comm_wrapper`` compresses what that hook sends (fp16 or
    bf16; with ``comm_hook="no"`` it wraps the plain all-reduce), and ``comm_state_option``
    configures PowerSGD's state. Every combination works on gloo as well as nccl.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        o = "DistributedDataParallelKwargs"
        v.check_number(o, "dim", self.dim, integer=True, ge=0)
        v.check_number(o, "bucket_cap_mb", self.bucket_cap_mb, gt=0)
        v.check_number(o, "bucket_cap_mb", self.bucket_cap_mb, lt=(INT64_MAX + 1) / 2**20)  # bytes in an int64
        for name in (
            "broadcast_buffers",
            "find_unused_parameters",
            "check_reduction",
            "gradient_as_bucket_view",
            "static_graph",
        ):
            v.check_bool(o, name, getattr(self, name))
        self.comm_hook = DDPCommunicationHookType(v.check_choice(o, "comm_hook", self.comm_hook, COMM_HOOKS))
        self.comm_wrapper = DDPCommunicationHookType(
            v.check_choice(o, "comm_wrapper", self.comm_wrapper, COMM_WRAPPERS)
        )
        if not isinstance(self.comm_state_option, dict):
            raise TypeError(
                f"{o}.comm_state_option must be a dict, got {self.comm_state_option!r} "
                f"({type(self.comm_state_option).__name__})"
            )
        if self.comm_state_option and self.comm_hook.value not in POWER_SGD_HOOKS:
            raise ValueError(
                f"{o}.comm_state_option is only used by the PowerSGD hooks "
                f"({', '.join(map(repr, POWER_SGD_HOOKS))}), but comm_hook={self.comm_hook.value!r} "
                f"and comm_state_option={self.comm_state_option!r}"
            )
        for key, value in self.comm_state_option.items():
            if key not in POWER_SGD_OPTIONS:
                raise ValueError(
                    f"{o}.comm_state_option has unknown key {key!r}; allowed keys: "
                    f"{', '.join(map(repr, POWER_SGD_OPTIONS))}"
                )
            types = POWER_SGD_OPTIONS[key]
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                raise TypeError(
                    f"{o}.comm_state_option[{key!r}] must be of type "
                    f"{' or '.join(t.__name__ for t in types)}, got {value!r}"
                )
        rank = self.comm_state_option.get("matrix_approximation_rank")
        if rank is not None and rank < 1:
            raise ValueError(f"{o}.comm_state_option['matrix_approximation_rank'] must be >= 1, got {rank!r}")
        start = self.comm_state_option.get("start_powerSGD_iter")
        if start is not None and start < 1:
            raise ValueError(f"{o}.comm_state_option['start_powerSGD_iter'] must be >= 1, got {start!r}")
        feedback = self.comm_state_option.get("use_error_feedback", True) or self.comm_state_option.get(
            "warm_start", True
        )
        if start is not None and start < 2 and feedback:
            raise ValueError(
                f"{o}.comm_state_option['start_powerSGD_iter'] must be >= 2 while use_error_feedback or warm_start "
                f"is True (PowerSGD can only start after DDP's first two iterations), got {start!r}"
            )
        # PowerSGD seeds NumPy with random_seed; a NaN or negative epsilon turns every gradient into NaN.
        if "random_seed" in self.comm_state_option:
            v.check_number(
                o,
                "comm_state_option['random_seed']",
                self.comm_state_option["random_seed"],
                integer=True,
                ge=0,
                le=2**32 - 1,
            )
        for key in ("orthogonalization_epsilon", "min_compression_rate"):
            if key in self.comm_state_option:
                v.check_number(o, f"comm_state_option[{key!r}]", self.comm_state_option[key], ge=0)

    def to_kwargs(self) -> dict[str, Any]:
        """Non-default DDP constructor arguments (the comm_* fields are not among them)."""
        return {k: val for k, val in super().to_kwargs().items() if k not in _DDP_COMM_FIELDS}

    def constructor_kwargs(self) -> dict[str, Any]:
        """Every DDP constructor argument this handler holds, defaults included.

        ``broadcast_buffers=True`` is DDP's own default and is left for DDP to apply: recent
        torch deprecates passing it, and only ``False`` changes anything.
        """
        kwargs = {k: val for k, val in self.to_dict().items() if k not in _DDP_COMM_FIELDS}
        if kwargs["broadcast_buffers"]:
            del kwargs["broadcast_buffers"]
        return kwargs

    def register_comm_hook(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register the communication hook (and wrapper) these fields choose on a DDP model;
        nothing for the defaults (DDP's own all-reduce)."""
        from hasten.settings.comm_hooks import register_comm_hook

        register_comm_hook(model, self.comm_hook, self.comm_wrapper, self.comm_state_option)


# --------------------------------------------------------------------------- profiler


@dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments for ``torch.profiler.profile``, built by ``build()``.

    ``activities`` are names among "cpu", "cuda", "xpu", "mtia", "hpu" (None: torch's
    default), ``schedule_option`` the keyword arguments of ``torch.profiler.schedule``
    (wait, warmup, active, repeat, skip_first), and ``output_trace_dir`` a folder where
    ``accelerator.profile()`` writes one Chrome trace per rank. With ``step_with_optimizer``
    the schedule advances on each real optimizer step (no ``prof.step()`` calls needed).
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None
    step_with_optimizer: bool = False

    def __post_init__(self) -> None:
        o = "ProfileKwargs"
        if self.activities is not None:
            if isinstance(self.activities, str) or not isinstance(self.activities, (list, tuple)):
                raise TypeError(
                    f"{o}.activities must be a list of names among "
                    f"{', '.join(map(repr, PROFILER_ACTIVITIES))}, got {v.shown(self.activities)}"
                )
            self.activities = [
                v.check_choice(o, "activities", a.lower() if isinstance(a, str) else a, PROFILER_ACTIVITIES)
                for a in self.activities
            ]
            if not self.activities:
                raise ValueError(
                    f"{o}.activities must name at least one of {', '.join(map(repr, PROFILER_ACTIVITIES))} "
                    "(or be None for torch's default), got []"
                )
        if self.schedule_option is not None:
            if not isinstance(self.schedule_option, dict):
                raise TypeError(f"{o}.schedule_option must be a dict or None, got {v.shown(self.schedule_option)}")
            for key, value in self.schedule_option.items():
                if key not in SCHEDULE_KEYS:
                    raise ValueError(
                        f"{o}.schedule_option has unknown key {v.shown(key)}; allowed keys: "
                        f"{', '.join(map(repr, SCHEDULE_KEYS))}"
                    )
                v.check_number(o, f"schedule_option[{key!r}]", value, integer=True, ge=1 if key == "active" else 0)
            if "active" not in self.schedule_option:
                raise ValueError(
                    f"{o}.schedule_option needs an 'active' count >= 1, got {v.shown(self.schedule_option)}"
                )
        v.check_callable(o, "on_trace_ready", self.on_trace_ready)
        for name in (
            "record_shapes",
            "profile_memory",
            "with_stack",
            "with_flops",
            "with_modules",
            "step_with_optimizer",
        ):
            v.check_bool(o, name, getattr(self, name))
        if self.output_trace_dir is not None:
            if not isinstance(self.output_trace_dir, (str, os.PathLike)):
                raise TypeError(
                    f"{o}.output_trace_dir must be a path (str or os.PathLike) or None, "
                    f"got {v.shown(self.output_trace_dir)}"
                )
            self.output_trace_dir = os.fspath(self.output_trace_dir)
            if not self.output_trace_dir:
                raise ValueError(f"{o}.output_trace_dir must be a non-empty path or None, got ''")
            locations.refuse_url(o, "output_trace_dir", self.output_trace_dir)  # never a local folder "s3:"
            # refused now, not when profile() first writes a trace (after the profiled loop began)
            v.check_writable_folder(
                o,
                "output_trace_dir",
                self.output_trace_dir,
                "it must be a folder (created if missing) where each rank writes its Chrome trace, or None",
            )

    def _torch_activities(self) -> list | None:
        if self.activities is None:
            return None
        from torch.profiler import ProfilerActivity

        return [getattr(ProfilerActivity, a.upper()) for a in self.activities]

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` configured by these fields."""
        import torch.profiler

        schedule = None
        if self.schedule_option:
            # torch's schedule requires wait and warmup; absent here they mean 0.
            schedule = torch.profiler.schedule(**{"wait": 0, "warmup": 0, **self.schedule_option})
        return torch.profiler.profile(
            activities=self._torch_activities(),
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


# --------------------------------------------------------------------------- process group

DEFAULT_NCCL_TIMEOUT = timedelta(seconds=600)
DEFAULT_TIMEOUT = timedelta(seconds=1800)


class _AutoBackend(str):
    """The default backend value: equal to "nccl", but means "choose for me"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str.__repr__(str(self))


class _AutoTimeout(timedelta):
    """A timeout the user did not write: chosen from the backend actually used."""

    __slots__ = ()

    def __repr__(self) -> str:
        return timedelta.__repr__(timedelta(seconds=self.total_seconds()))


def default_timeout(backend: str) -> timedelta:
    return DEFAULT_NCCL_TIMEOUT if backend == "nccl" else DEFAULT_TIMEOUT


def _known_backends() -> list[str]:
    import torch.distributed as dist

    return [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``.

    The default ``backend="nccl"`` means "choose for me": gloo on CPU, nccl on CUDA.
    ``timeout=None`` becomes 600 s for nccl and 1800 s otherwise; a timeout the user wrote
    is always the one applied, even when it equals a default.
    """

    backend: str | None = _AutoBackend("nccl")
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        o = "InitProcessGroupKwargs"
        if self.backend is None:
            self.backend = _AutoBackend("nccl")
        elif not isinstance(self.backend, _AutoBackend):
            if not isinstance(self.backend, str) or not self.backend:
                raise TypeError(f"{o}.backend must be a backend name such as 'gloo' or 'nccl', got {self.backend!r}")
            known = _known_backends()
            # "cpu:gloo,cuda:nccl" style strings name one backend per device.
            parts = [p.split(":")[-1].strip().lower() for p in self.backend.split(",")]
            for part in parts:
                if part not in known:
                    raise ValueError(f"{o}.backend must be one of {', '.join(map(repr, known))}, got {self.backend!r}")
            if len(parts) == 1:
                self.backend = parts[0]
        if self.init_method is not None and not isinstance(self.init_method, str):
            raise TypeError(
                f"{o}.init_method must be a URL string such as 'tcp://host:port' or 'env://', or None, "
                f"got {self.init_method!r}"
            )
        if self.timeout is None or isinstance(self.timeout, _AutoTimeout):
            base = default_timeout(self.backend)
            self.timeout = _AutoTimeout(seconds=base.total_seconds())
        elif not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"{o}.timeout must be a datetime.timedelta (e.g. timedelta(seconds=900)) or None, "
                f"got {self.timeout!r} ({type(self.timeout).__name__})"
            )
        elif self.timeout.total_seconds() <= 0:
            raise ValueError(f"{o}.timeout must be a positive timedelta, got {self.timeout!r}")
        elif self.timeout < MIN_TIMEOUT:
            raise ValueError(
                f"{o}.timeout must be at least {MIN_TIMEOUT!r} (1 ms: torch's stores count whole milliseconds), "
                f"got {self.timeout!r}"
            )
        elif self.timeout > MAX_TIMEOUT:
            raise ValueError(f"{o}.timeout must be at most {MAX_TIMEOUT!r} (100 years), got {self.timeout!r}")

    @property
    def backend_is_auto(self) -> bool:
        return isinstance(self.backend, _AutoBackend)

    @property
    def timeout_is_auto(self) -> bool:
        return isinstance(self.timeout, _AutoTimeout)

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_kwargs()
        if not self.timeout_is_auto:  # what the user wrote is kept, even if equal to a default
            kwargs["timeout"] = self.timeout
        return kwargs

    def process_group_kwargs(self, device_type: str) -> dict[str, Any]:
        """Arguments of ``init_process_group`` for a process whose device type is given."""
        backend = str(self.backend)
        if self.backend_is_auto:
            backend = "nccl" if device_type == "cuda" else "gloo"
        elif "nccl" in backend.split(",")[0] and device_type != "cuda" and ":" not in backend:
            raise ValueError(
                f"InitProcessGroupKwargs.backend='nccl' needs CUDA devices, but this process runs on "
                f"{device_type!r}; use backend='gloo' for CPU training"
            )
        timeout = default_timeout(backend) if self.timeout_is_auto else self.timeout
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
        if self.init_method is not None:
            kwargs["init_method"] = self.init_method
        return kwargs
