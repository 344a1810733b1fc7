"""Accelerate's DeepSpeed configuration classes, so code that names them imports.

``DeepSpeedPlugin`` and ``DeepSpeedSequenceParallelConfig`` are Accelerate's
(``accelerate.utils.dataclasses``), with its fields and defaults. hasten does not run DeepSpeed:
they can be built and read, but using one is refused, naming DeepSpeed and what to use instead:
``Accelerator(deepspeed_plugin=...)`` (``hasten.settings.resolve``, the one refusal of
Accelerate's DeepSpeed arguments), a plugin's DeepSpeed methods (below), and a
``ParallelismConfig`` with ``sp_size > 1`` (``hasten.settings.parallelism``, which defines the
sequence-parallel handler; re-exported here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn

from hasten.settings.parallelism import DeepSpeedSequenceParallelConfig

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedPlugin",
    "DeepSpeedSchedulerWrapper",
    "DeepSpeedSequenceParallelConfig",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
]

#: what a DeepSpeed user runs instead on hasten
INSTEAD = (
    "shard with FSDP2 instead: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()), ZeRO-3's counterpart "
    "(reshard_after_forward=False for ZeRO-2's; cpu_offload=True for offloading), or train with DDP (no plugin)"
)


def refuse_deepspeed(what: str) -> NoReturn:
    """Raise the error of a DeepSpeed feature used: hasten does not run DeepSpeed."""
    raise NotImplementedError(f"{what} needs DeepSpeed, which hasten does not run; {INSTEAD}")


@dataclass(repr=False)
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed plugin, with its fields and defaults; nothing is read from the
    environment or from ``hf_ds_config``. It can be built (code that makes one imports and
    runs up to where it is used); ``Accelerator(deepspeed_plugin=...)`` and its DeepSpeed
    methods are refused, naming what to use instead (FSDP2 or DDP)."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None

    def __repr__(self) -> str:
        """The fields given (not their defaults), so an error quoting a plugin stays one line."""
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"DeepSpeedPlugin({', '.join(given)})"

    def _refuse(self, method: str) -> NoReturn:
        refuse_deepspeed(f"DeepSpeedPlugin.{method}()")

    def deepspeed_config_process(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("deepspeed_config_process")

    def fill_match(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("fill_match")

    def is_auto(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("is_auto")

    def get_value(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("get_value")

    def set_mixed_precision(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_mixed_precision")

    def set_deepspeed_weakref(self) -> NoReturn:
        self._refuse("set_deepspeed_weakref")

    def is_zero3_init_enabled(self) -> NoReturn:
        self._refuse("is_zero3_init_enabled")

    def zero3_init_context_manager(self, enable: bool = False) -> NoReturn:
        self._refuse("zero3_init_context_manager")

    def set_moe_leaf_modules(self, model: Any) -> NoReturn:
        self._refuse("set_moe_leaf_modules")

    def select(self, _from_accelerator_state: bool = False) -> NoReturn:
        self._refuse("select")


class _RefusedWhenMade:
    """Accelerate's DeepSpeed helper classes: importable (transformers' Trainer and its DeepSpeed
    integration import them at module level, and subclass ``HfDeepSpeedConfig``), refused when made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_deepspeed(type(self).__name__)


class HfDeepSpeedConfig(_RefusedWhenMade):
    """Accelerate's reader of a DeepSpeed config file (refused when made: hasten does not run DeepSpeed)."""


class DeepSpeedEngineWrapper(_RefusedWhenMade):
    """Accelerate's wrapper of a DeepSpeed engine (refused when made)."""


class DeepSpeedOptimizerWrapper(_RefusedWhenMade):
    """Accelerate's wrapper of a DeepSpeed optimizer (refused when made)."""


class DeepSpeedSchedulerWrapper(_RefusedWhenMade):
    """Accelerate's wrapper of a DeepSpeed scheduler (refused when made)."""


class DummyOptim(_RefusedWhenMade):
    """Accelerate's placeholder for an optimizer named in a DeepSpeed config (refused when made)."""


class DummyScheduler(_RefusedWhenMade):
    """Accelerate's placeholder for a scheduler named in a DeepSpeed config (refused when made)."""
