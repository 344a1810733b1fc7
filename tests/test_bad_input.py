"""Bad input is refused where it enters, with a message naming the field, the value and what is allowed.

``CASES`` is the table: every field of every kwargs handler with a value of the wrong type
and (where the field has a range or a set of choices) a value outside it, the Accelerator's
arguments and misspelt keywords, its launcher environment, ``prepare()`` of what it cannot
prepare, a dataloader with fewer batches than processes, config files with unknown keys or
bad values, and out-of-range ``hasten launch``/``hasten config`` flags. Each row must raise
exactly its error type (``SystemExit`` means argparse's exit status 2 with a message).

The same table is the source of ``docs/errors.md``: ``python tests/gen_errors_doc.py``
writes it, and ``test_errors_doc_is_current`` fails when it is stale.

Detailed checks of single messages live beside their modules (tests/test_handlers.py,
test_config.py, test_accelerator.py, test_cli.py); this table is the uniform contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import (
    Accelerator,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ParallelismConfig,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from hasten.checkpoint.errors import UnsafeCheckpoint
from hasten.cli import main as cli_main
from hasten.data_loader.prepare import prepare_loader as prepare_data_loader
from hasten.settings import config_file as hasten_config
from hasten.state import GradientState
from hasten.training.rng import set_seed

HANDLERS = (AutocastKwargs, GradScalerKwargs, DistributedDataParallelKwargs, ProfileKwargs, InitProcessGroupKwargs)
DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


@dataclass(frozen=True)
class Case:
    """One bad input: where it enters, how a user writes it, and the refusal expected."""

    entry: str  # the entry point (a section of docs/errors.md)
    what: str  # the input as a user writes it
    call: Callable[[Path], Any]  # does it, given a scratch folder
    error: type[BaseException]  # ValueError, TypeError, FileNotFoundError or SystemExit (argparse, status 2)
    words: tuple[str, ...]  # must all be in the message: the field, the value, what is allowed
    field: str | None = None  # for handler rows: the dataclass field refused


# ---------------------------------------------------------------------- handler rows


def bad(
    cls: type, field: str, value: Any, error: type[BaseException], *allowed: str, shown: str | None = None, **other: Any
) -> Case:
    """``cls(field=value, **other)`` must raise ``error`` naming ``cls.field``, the value and ``allowed``."""
    args = ", ".join(f"{k}={v!r}" for k, v in {**other, field: value}.items())
    value_words = () if isinstance(value, (list, dict, tuple)) else (repr(value),)
    return Case(
        cls.__name__,
        shown or f"{cls.__name__}({args})",
        lambda _d: cls(**other, **{field: value}),
        error,
        (f"{cls.__name__}.{field}", *value_words, *allowed),
        field=field,
    )


T, V = TypeError, ValueError
BOOL = "must be True or False"
HOOKS = "'no', 'fp16', 'bf16', 'power_sgd', 'batched_power_sgd'"
ACTIVITIES = "'cpu', 'cuda', 'xpu', 'mtia', 'hpu'"
PSGD = {"comm_hook": "power_sgd"}

HANDLER_CASES = [
    bad(AutocastKwargs, "enabled", "yes", T, BOOL),
    bad(AutocastKwargs, "cache_enabled", 0, T, "must be True, False or None"),
    bad(GradScalerKwargs, "init_scale", "big", T, "must be a number"),
    bad(GradScalerKwargs, "init_scale", 0, V, "must be > 0"),
    bad(GradScalerKwargs, "init_scale", 1e39, V, "<= 3.4028234663852886e+38"),
    bad(GradScalerKwargs, "init_scale", 1e-40, V, ">= 1.1754943508222875e-38"),
    bad(GradScalerKwargs, "init_scale", math.nan, V, "finite", shown="GradScalerKwargs(init_scale=float('nan'))"),
    bad(GradScalerKwargs, "growth_factor", None, T, "must be a number"),
    bad(GradScalerKwargs, "growth_factor", 1.0, V, "must be > 1"),
    bad(
        GradScalerKwargs,
        "growth_factor",
        1.00000001,
        V,
        "must be > 1 in float32",
        "1.0000001192092896",
        "which is 1.0 in float32",
    ),
    bad(GradScalerKwargs, "growth_factor", 1e39, V, "<= 3.4028234663852886e+38"),
    bad(GradScalerKwargs, "backoff_factor", "half", T, "must be a number"),
    bad(GradScalerKwargs, "backoff_factor", 1.5, V, "must be > 0 and < 1"),
    bad(GradScalerKwargs, "backoff_factor", 1e-40, V, ">= 1.1754943508222875e-38"),
    bad(
        GradScalerKwargs,
        "backoff_factor",
        0.99999999,
        V,
        "must be < 1 in float32",
        "0.9999999403953552",
        "which is 1.0 in float32",
    ),
    bad(GradScalerKwargs, "growth_interval", 2.5, T, "must be an integer"),
    bad(GradScalerKwargs, "growth_interval", 0, V, "must be >= 1"),
    bad(GradScalerKwargs, "growth_interval", 2**63, V, "<= 9223372036854775807"),
    bad(GradScalerKwargs, "enabled", "no", T, BOOL),
    bad(DistributedDataParallelKwargs, "dim", 1.5, T, "must be an integer"),
    bad(DistributedDataParallelKwargs, "dim", -1, V, "must be >= 0"),
    bad(DistributedDataParallelKwargs, "broadcast_buffers", 1, T, BOOL),
    bad(DistributedDataParallelKwargs, "bucket_cap_mb", "25", T, "must be a number"),
    bad(DistributedDataParallelKwargs, "bucket_cap_mb", 0, V, "must be > 0"),
    bad(DistributedDataParallelKwargs, "bucket_cap_mb", 1e13, V, "must be < 8796093022208"),
    bad(DistributedDataParallelKwargs, "find_unused_parameters", "yes", T, BOOL),
    bad(DistributedDataParallelKwargs, "check_reduction", None, T, BOOL),
    bad(DistributedDataParallelKwargs, "gradient_as_bucket_view", 0, T, BOOL),
    bad(DistributedDataParallelKwargs, "static_graph", "true", T, BOOL),
    bad(DistributedDataParallelKwargs, "comm_hook", 3, T, HOOKS),
    bad(DistributedDataParallelKwargs, "comm_hook", "fp8", V, HOOKS),
    bad(DistributedDataParallelKwargs, "comm_wrapper", None, T, "'no', 'fp16', 'bf16'"),
    bad(DistributedDataParallelKwargs, "comm_wrapper", "power_sgd", V, "must be one of 'no', 'fp16', 'bf16', got"),
    bad(DistributedDataParallelKwargs, "comm_state_option", [1], T, "must be a dict", "[1]"),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"matrix_approximation_rank": 2},
        V,
        "only used by the PowerSGD hooks",
        "'power_sgd', 'batched_power_sgd'",
        "comm_hook='no'",
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"rank": 2},
        V,
        "unknown key 'rank'",
        "'matrix_approximation_rank', 'start_powerSGD_iter'",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"warm_start": 1},
        T,
        "['warm_start'] must be of type bool",
        "got 1",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"matrix_approximation_rank": 0},
        V,
        "['matrix_approximation_rank'] must be >= 1",
        "got 0",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"start_powerSGD_iter": 0},
        V,
        "['start_powerSGD_iter'] must be >= 1",
        "got 0",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"start_powerSGD_iter": 1},
        V,
        "['start_powerSGD_iter'] must be >= 2 while use_error_feedback or warm_start is True",
        "got 1",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"random_seed": -1},
        V,
        "['random_seed'] must be >= 0 and <= 4294967295",
        "got -1",
        **PSGD,
    ),
    bad(
        DistributedDataParallelKwargs,
        "comm_state_option",
        {"orthogonalization_epsilon": math.nan},
        V,
        "['orthogonalization_epsilon'] must be a finite number",
        "got nan",
        **PSGD,
        shown=(
            "DistributedDataParallelKwargs(comm_hook='power_sgd', comm_state_option={'orthogonalization_epsilon': "
            "float('nan')})"
        ),
    ),
    bad(ProfileKwargs, "activities", "cpu", T, f"must be a list of names among {ACTIVITIES}"),
    bad(ProfileKwargs, "activities", ["gpu"], V, ACTIVITIES, "got 'gpu'"),
    bad(ProfileKwargs, "activities", [], V, "at least one", ACTIVITIES),
    bad(ProfileKwargs, "schedule_option", [1], T, "must be a dict or None", "[1]"),
    bad(
        ProfileKwargs, "schedule_option", {"active": 1.5}, T, "schedule_option['active'] must be an integer", "got 1.5"
    ),
    bad(ProfileKwargs, "schedule_option", {"active": 0}, V, "schedule_option['active'] must be >= 1", "got 0"),
    bad(ProfileKwargs, "schedule_option", {"wait": 1}, V, "needs an 'active' count >= 1"),
    bad(
        ProfileKwargs,
        "schedule_option",
        {"active": 1, "warm": 1},
        V,
        "unknown key 'warm'",
        "'wait', 'warmup', 'active', 'repeat', 'skip_first'",
    ),
    bad(ProfileKwargs, "on_trace_ready", "print", T, "must be a callable or None"),
    bad(ProfileKwargs, "record_shapes", 1, T, BOOL),
    bad(ProfileKwargs, "profile_memory", "no", T, BOOL),
    bad(ProfileKwargs, "with_stack", None, T, BOOL),
    bad(ProfileKwargs, "with_flops", 0, T, BOOL),
    bad(ProfileKwargs, "with_modules", "yes", T, BOOL),
    bad(ProfileKwargs, "output_trace_dir", 3, T, "must be a path (str or os.PathLike) or None"),
    bad(ProfileKwargs, "output_trace_dir", "", V, "must be a non-empty path or None"),
    bad(ProfileKwargs, "step_with_optimizer", 1, T, BOOL),
    bad(InitProcessGroupKwargs, "backend", 5, T, "must be a backend name such as 'gloo' or 'nccl'"),
    bad(InitProcessGroupKwargs, "backend", "glue", V, "must be one of", "'gloo'", "'nccl'"),
    bad(
        InitProcessGroupKwargs,
        "init_method",
        5,
        T,
        "must be a URL string such as 'tcp://host:port' or 'env://', or None",
    ),
    bad(InitProcessGroupKwargs, "timeout", 30, T, "must be a datetime.timedelta", "or None"),
    bad(InitProcessGroupKwargs, "timeout", timedelta(0), V, "must be a positive timedelta"),
    bad(InitProcessGroupKwargs, "timeout", timedelta(days=36501), V, "must be at most datetime.timedelta(days=36500)"),
    bad(
        InitProcessGroupKwargs,
        "timeout",
        timedelta(microseconds=500),
        V,
        "must be at least datetime.timedelta(microseconds=1000)",
        "torch's stores count whole milliseconds",
    ),
]

# The Accelerator's option dataclasses (hasten.settings.plugins), as Accelerate names them.
OPTION_CASES = [
    bad(ProjectConfiguration, "project_dir", 5, T, "must be a path (str or os.PathLike) or None"),
    bad(ProjectConfiguration, "logging_dir", 1.5, T, "must be a path (str or os.PathLike) or None"),
    bad(ProjectConfiguration, "automatic_checkpoint_naming", "yes", T, BOOL),
    bad(ProjectConfiguration, "total_limit", 0, V, "must be >= 1"),
    bad(ProjectConfiguration, "iteration", -1, V, "must be >= 0"),
    bad(ProjectConfiguration, "save_on_each_node", 1, T, BOOL),
    bad(ProjectConfiguration, "async_save", "yes", T, BOOL),
    bad(GradientAccumulationPlugin, "num_steps", 2.0, T, "must be an integer"),
    bad(GradientAccumulationPlugin, "num_steps", 0, V, "must be >= 1"),
    bad(GradientAccumulationPlugin, "adjust_scheduler", 1, T, BOOL),
    bad(GradientAccumulationPlugin, "sync_with_dataloader", None, T, BOOL),
    bad(GradientAccumulationPlugin, "sync_each_batch", "yes", T, BOOL),
    bad(DataLoaderConfiguration, "split_batches", 1, T, BOOL),
    bad(DataLoaderConfiguration, "dispatch_batches", "yes", T, "must be True, False or None"),
    bad(DataLoaderConfiguration, "even_batches", None, T, BOOL),
    bad(DataLoaderConfiguration, "use_seedable_sampler", "no", T, BOOL),
    bad(DataLoaderConfiguration, "data_seed", 1.5, T, "must be an integer"),
    bad(DataLoaderConfiguration, "data_seed", -1, V, "must be >= 0 and <= 9223372036854775807"),
    bad(DataLoaderConfiguration, "non_blocking", 0, T, BOOL),
    bad(DataLoaderConfiguration, "use_stateful_dataloader", True, V, "not supported by hasten", "use False"),
    bad(ParallelismConfig, "dp_shard_size", 0, V, "must be >= 1"),
    bad(ParallelismConfig, "tp_size", "2", T, "must be an integer"),
    bad(
        ParallelismConfig,
        "tp_plan",
        {"layers.*.q": "diagonal"},
        V,
        "'diagonal'",
        "allowed: colwise, rowwise",
        tp_size=2,
    ),
]

# Fields with no range or choice to leave: booleans, a callable, a URL that torch parses.
NO_RANGE = {"on_trace_ready", "init_method"}


# ---------------------------------------------------------------------- Accelerator rows


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def with_env(values: dict[str, str], fn: Callable[[], Any]) -> Callable[[Path], Any]:
    def call(_d: Path) -> Any:
        with environment(**values):
            return fn()

    return call


def acc(what: str, error: type[BaseException], *words: str, **kwargs: Any) -> Case:
    return Case("Accelerator()", what, lambda _d: Accelerator(**kwargs), error, words)


MP = "'no', 'fp16', 'bf16', 'fp8'"
ACCELERATOR_CASES = [
    acc(
        "Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2)) on 1 process",
        V,
        "dp_shard_size=2",
        "tp_size=2",
        "multiplies to 4",
        "1 process(es)",
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
    ),
    acc(
        "Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))",
        V,
        "cp_size=2",
        "needs CUDA",
        "'cpu'",
        cpu=True,
        parallelism_config=ParallelismConfig(cp_size=2),
    ),
    acc("Accelerator(mixed_precision='fp4')", V, "Accelerator.mixed_precision", MP, "'fp4'", mixed_precision="fp4"),
    acc("Accelerator(mixed_precision=16)", T, "Accelerator.mixed_precision", MP, "got 16", mixed_precision=16),
    acc(
        "Accelerator(gradient_accumulation_steps=0)",
        V,
        "Accelerator.gradient_accumulation_steps",
        ">= 1",
        "got 0",
        gradient_accumulation_steps=0,
    ),
    acc(
        "Accelerator(gradient_accumulation_steps=2.0)",
        T,
        "Accelerator.gradient_accumulation_steps",
        "an integer",
        "2.0",
        gradient_accumulation_steps=2.0,
    ),
    acc("Accelerator(cpu='yes')", T, "Accelerator.cpu", BOOL, "'yes'", cpu="yes"),
    acc("Accelerator(device_placement=None)", T, "Accelerator.device_placement", BOOL, device_placement=None),
    acc("Accelerator(split_batches=1)", T, "Accelerator.split_batches", BOOL, split_batches=1),
    acc("Accelerator(even_batches='no')", T, "Accelerator.even_batches", BOOL, even_batches="no"),
    acc(
        "Accelerator(step_scheduler_with_optimizer=0)",
        T,
        "Accelerator.step_scheduler_with_optimizer",
        BOOL,
        step_scheduler_with_optimizer=0,
    ),
    acc(
        "Accelerator(project_dir=5)",
        T,
        "Accelerator.project_dir",
        "a path (str or os.PathLike) or None",
        "got 5",
        project_dir=5,
    ),
    acc(
        "Accelerator(project_dir='a', project_config=ProjectConfiguration(project_dir='b'))",
        V,
        "Accelerator(project_dir='a') conflicts with ProjectConfiguration(project_dir='b')",
        "give the project directory once",
        project_dir="a",
        project_config=ProjectConfiguration(project_dir="b"),
    ),
    acc(
        "Accelerator(project_config={'project_dir': 'runs'})",
        T,
        "Accelerator.project_config must be a ProjectConfiguration",
        project_config={"project_dir": "runs"},
    ),
    acc(
        "Accelerator(gradient_accumulation_steps=2, "
        "gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))",
        V,
        "both gradient_accumulation_steps=2 and gradient_accumulation_plugin=",
        "pass one",
        gradient_accumulation_steps=2,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
    ),
    acc(
        "Accelerator(split_batches=True, dataloader_config=DataLoaderConfiguration())",
        V,
        "got dataloader_config and split_batches=True",
        "set split_batches in the DataLoaderConfiguration only",
        split_batches=True,
        dataloader_config=DataLoaderConfiguration(),
    ),
    acc(
        "Accelerator(dataloader_config={'split_batches': True})",
        T,
        "Accelerator.dataloader_config must be a DataLoaderConfiguration",
        dataloader_config={"split_batches": True},
    ),
    acc(
        "Accelerator(log_with='tensorbord')",
        V,
        "Accelerator.log_with",
        "'all', 'aim', 'tensorboard', 'wandb'",
        "'mlflow'",
        "a GeneralTracker instance",
        "got 'tensorbord'",
        log_with="tensorbord",
    ),
    acc("Accelerator(log_with=[5])", T, "Accelerator.log_with", "got 5 (int)", log_with=[5]),
    acc(
        "Accelerator(log_with='tensorboard')  # no project_dir",
        V,
        "log_with='tensorboard'",
        "requires a `logging_dir`",
        "project_dir=...",
        log_with="tensorboard",
    ),
    acc(
        "Accelerator(kwargs_handlers=GradScalerKwargs())",
        T,
        "kwargs_handlers must be a list",
        kwargs_handlers=GradScalerKwargs(),
    ),
    acc(
        "Accelerator(kwargs_handlers=[{'bucket_cap_mb': 5}])",
        T,
        "kwargs_handlers got {'bucket_cap_mb': 5}",
        "allowed: AutocastKwargs, DistributedDataParallelKwargs",
        kwargs_handlers=[{"bucket_cap_mb": 5}],
    ),
    acc(
        "Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs(init_scale=8.0)])",
        V,
        "two GradScalerKwargs",
        "pass one",
        kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs(init_scale=8.0)],
    ),
    # misspelt keywords
    acc(
        "Accelerator(mixed_precison='fp16')",
        T,
        "'mixed_precison'",
        "did you mean 'mixed_precision'?",
        mixed_precison="fp16",
    ),
    acc(
        "Accelerator(gradient_accumulation_step=2)",
        T,
        "'gradient_accumulation_step'",
        "did you mean 'gradient_accumulation_steps'?",
        gradient_accumulation_step=2,
    ),
    acc(
        "Accelerator(kwargs_handler=[GradScalerKwargs()])",
        T,
        "'kwargs_handler'",
        "did you mean 'kwargs_handlers'?",
        kwargs_handler=[GradScalerKwargs()],
    ),
    acc(
        "Accelerator(deepspeed_plugin=...)",
        T,
        "Accelerate's argument for DeepSpeed",
        "hasten does not support it",
        deepspeed_plugin="plugin",
    ),
    acc(
        "Accelerator(dynamo_backend='fastest')",
        V,
        "TorchDynamoPlugin.backend",
        "'fastest'",
        "'aot_eager'",
        "'inductor'",
        dynamo_backend="fastest",
    ),
    acc(
        "Accelerator(dynamo_backend='aot_ts_nvfuser')  # an Accelerate name this torch lacks",
        V,
        "TorchDynamoPlugin.backend='aot_ts_nvfuser' is not a torch.compile backend of this torch",
        "'inductor'",
        dynamo_backend="aot_ts_nvfuser",
    ),
    acc(
        "Accelerator(dynamo_backend='eager', dynamo_plugin=TorchDynamoPlugin())",
        V,
        "dynamo_backend='eager'",
        "and dynamo_plugin=",
        "pass one",
        dynamo_backend="eager",
        dynamo_plugin=TorchDynamoPlugin(),
    ),
    acc(
        "Accelerator(rng_types=['generator'])",
        T,
        "rng_types=['generator']",
        "one seeded sampler on every process",
        rng_types=["generator"],
    ),
    acc(
        "Accelerator(project_directory='runs')",
        T,
        "'project_directory'",
        "did you mean 'project_dir'?",
        project_directory="runs",
    ),
    acc("Accelerator(fp16=True)", T, "'fp16'", "allowed: device_placement, split_batches, mixed_precision", fp16=True),
]

ENV = "environment of Accelerator()"
ENV_CASES = [
    Case(
        ENV,
        "HASTEN_MIXED_PRECISION=fp64",
        with_env({"HASTEN_MIXED_PRECISION": "fp64"}, Accelerator),
        V,
        ("HASTEN_MIXED_PRECISION", MP, "'fp64'"),
    ),
    Case(
        ENV,
        "HASTEN_GRADIENT_ACCUMULATION_STEPS=zero",
        with_env({"HASTEN_GRADIENT_ACCUMULATION_STEPS": "zero"}, Accelerator),
        V,
        ("HASTEN_GRADIENT_ACCUMULATION_STEPS", "an integer >= 1", "'zero'"),
    ),
    Case(
        ENV,
        "HASTEN_GRADIENT_ACCUMULATION_STEPS=0",
        with_env({"HASTEN_GRADIENT_ACCUMULATION_STEPS": "0"}, Accelerator),
        V,
        ("HASTEN_GRADIENT_ACCUMULATION_STEPS", ">= 1", "got 0"),
    ),
    Case(ENV, "WORLD_SIZE=two", with_env({"WORLD_SIZE": "two"}, Accelerator), V, ("WORLD_SIZE", "an integer", "'two'")),
    Case(
        ENV,
        "RANK=2 WORLD_SIZE=2",
        with_env({"RANK": "2", "WORLD_SIZE": "2"}, Accelerator),
        V,
        ("RANK=2", "[0, WORLD_SIZE=2)"),
    ),
    Case(
        ENV,
        "HASTEN_USE_CPU=garbage",
        with_env({"HASTEN_USE_CPU": "garbage"}, Accelerator),
        V,
        ("environment variable HASTEN_USE_CPU", "1/0, true/false, yes/no, on/off", "'garbage'"),
    ),
    Case(
        ENV,
        "HASTEN_CONFIG_FILE=<dir>  # a folder",
        lambda d: with_env({"HASTEN_CONFIG_FILE": str(d)}, Accelerator)(d),
        V,
        ("config file '<dir>' (from HASTEN_CONFIG_FILE) is a folder, not a file", "name the YAML file itself"),
    ),
    Case(
        ENV,
        "HASTEN_CONFIG_FILE=/dev/zero",
        with_env({"HASTEN_CONFIG_FILE": "/dev/zero"}, Accelerator),
        V,
        ("'/dev/zero' (from HASTEN_CONFIG_FILE) is not a regular file",),
    ),
    Case(
        ENV,
        "HASTEN_CONFIG_FILE=<dir>/big.yaml  # 2 MB",
        lambda d: with_env({"HASTEN_CONFIG_FILE": str(_sparse(d / "big.yaml", 2_000_000))}, Accelerator)(d),
        V,
        ("(from HASTEN_CONFIG_FILE) is 2000000 bytes", "at most 1048576 bytes (1 MiB)"),
    ),
]


def _sparse(path: Path, size: int) -> Path:
    with open(path, "w") as f:
        f.truncate(size)
    return path


# ---------------------------------------------------------------------- prepare() and other methods


def _loader(n: int = 8, **kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), **kwargs)


def _quantized_offloaded() -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit = True  # as transformers marks a bitsandbytes model
    model.hf_device_map = {"": "cpu"}
    return model


def prep(what: str, error: type[BaseException], words: tuple[str, ...], *objects: Any, **kwargs: Any) -> Case:
    return Case("Accelerator.prepare()", what, lambda _d: Accelerator().prepare(*objects, **kwargs), error, words)


PREPARE_WORDS = (
    "it takes torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader and torch.optim.lr_scheduler",
)
PREPARE_CASES = [
    prep(
        "prepare(torch.nn.Linear)  # the class, not a model",
        T,
        ("prepare() cannot prepare the class Linear", *PREPARE_WORDS),
        torch.nn.Linear,
    ),
    prep(
        "prepare(model)  # loaded in 8-bit with CPU offload",
        V,
        ("loaded in 8-bit or 4-bit precision with CPU or disk offload", "cannot be trained"),
        _quantized_offloaded(),
    ),
    prep(
        "prepare(model)  # built on the meta device, without fsdp_plugin",
        V,
        ("prepare() got a model on the meta device (weight and maybe more)", "only FSDP"),
        torch.nn.Linear(2, 2, device="meta"),
    ),
    prep(
        "prepare(model, device_placement=True)",
        T,
        ("prepare.device_placement", "a list of True/False, one per object"),
        torch.nn.Linear(2, 2),
        device_placement=True,
    ),
    prep(
        "prepare(model, device_placement=[True, False])",
        V,
        ("device_placement has 2 entries for 1 objects",),
        torch.nn.Linear(2, 2),
        device_placement=[True, False],
    ),
    prep(
        "prepare(DataLoader(dataset, batch_size=None))",
        V,
        ("batch_size=None is not supported",),
        _loader(batch_size=None),
    ),
    Case(
        "Accelerator.prepare()",
        "Accelerator(device_placement=False, "
        "dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).prepare(loader)",
        lambda _d: Accelerator(
            device_placement=False, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
        ).prepare(_loader(batch_size=2)),
        V,
        ("dispatch_batches=True needs the batches placed on the device", "device_placement=True"),
    ),
]


def on_rank(rank: int, loader: DataLoader, **kwargs: Any) -> Callable[[Path], Any]:
    """prepare() of ``loader`` as rank ``rank`` of 2 processes sees it (no process group needed)."""
    state = SimpleNamespace(
        num_processes=2, process_index=rank, device=torch.device("cpu"), use_distributed=True, backend="gloo"
    )
    return lambda _d: prepare_data_loader(loader, state, GradientState(), **kwargs)


FEWER = ("fewer than the 2 processes", "every process needs at least one batch")
DATA = "Accelerator.prepare() of a DataLoader on 2 processes"
DATA_CASES = (
    [
        Case(
            DATA,
            f"rank {r}: prepare(DataLoader(3 samples, batch_size=4, drop_last=True))",
            on_rank(r, _loader(3, batch_size=4, drop_last=True)),
            V,
            ("the dataloader has 0 batch(es)", *FEWER),
        )
        for r in (0, 1)
    ]
    + [
        Case(
            DATA,
            f"rank {r}: Accelerator(even_batches=False).prepare(DataLoader(3 samples, batch_size=4))",
            on_rank(r, _loader(3, batch_size=4), even_batches=False),
            V,
            ("the dataloader has 1 batch(es)", *FEWER),
        )
        for r in (0, 1)
    ]
    + [
        Case(
            DATA,
            "Accelerator(split_batches=True).prepare(DataLoader(dataset, batch_size=7))",
            on_rank(0, _loader(14, batch_size=7), split_batches=True),
            V,
            (
                "split_batches=True needs a batch_size divisible by the number of processes",
                "batch_size=7",
                "num_processes=2",
            ),
        ),
    ]
)


def _compat_prepare(**kwargs: Any) -> Callable[[Path], Any]:
    from hasten.data_loader import prepare_data_loader as accelerate_prepare

    return lambda _d: accelerate_prepare(_loader(batch_size=2), **kwargs)


COMPAT = "hasten.data_loader (Accelerate's data-loading names)"
COMPAT_CASES = [
    Case(
        COMPAT,
        "prepare_data_loader(loader, dispatch_batches=True)  # put_on_device=False",
        _compat_prepare(dispatch_batches=True),
        V,
        ("dispatch_batches=True needs the batches placed on the device", "put_on_device=True"),
    ),
    Case(
        COMPAT,
        "prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=True, dispatch_batches=True)"
        "  # one process running",
        _compat_prepare(num_processes=2, process_index=1, put_on_device=True, dispatch_batches=True),
        V,
        (
            "dispatch_batches=True sends each running process its part",
            "num_processes=2",
            "process_index=1",
            "must be those of the process group",
        ),
    ),
    Case(
        COMPAT,
        "prepare_data_loader(loader, put_on_device=True, dispatch_batches=True, slice_fn_for_dispatch=f)",
        _compat_prepare(put_on_device=True, dispatch_batches=True, slice_fn_for_dispatch=lambda *a, **k: a[0]),
        V,
        ("slice_fn_for_dispatch=...) is not supported", "cuts every tensor along dim 0"),
    ),
    Case(
        COMPAT,
        "prepare_data_loader(loader, dispatch_batches='yes')",
        _compat_prepare(dispatch_batches="yes"),
        T,
        ("prepare_data_loader.dispatch_batches", "'yes'", "must be True, False or None"),
    ),
]


def _tampered_load(a: Accelerator, d: Path, tamper: Callable[[Path], None], **save_kwargs: Any) -> Any:
    """Save a checkpoint of a small prepared model, change it as ``tamper`` does, load it."""
    a.prepare(torch.nn.Linear(2, 2))
    path = Path(a.save_state(d / "ckpt", **save_kwargs))
    tamper(path)
    return a.load_state(path)


def _edit_manifest(path: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((path / "hasten_checkpoint.json").read_text())
    edit(manifest)
    (path / "hasten_checkpoint.json").write_text(json.dumps(manifest))


def _move_model_outside(path: Path) -> None:
    os.replace(path / "model.safetensors", path.parent / "model.safetensors")

    def edit(m: dict) -> None:
        m["models"][0]["file"] = "../model.safetensors"
        m["files"]["../model.safetensors"] = m["files"].pop("model.safetensors")

    _edit_manifest(path, edit)


def _pickle_into_model(path: Path) -> None:
    import argparse
    import hashlib

    weights = torch.load(path / "pytorch_model.bin", weights_only=True)
    weights["extra"] = argparse.Namespace(payload="not a tensor")
    torch.save(weights, path / "pytorch_model.bin")
    data = (path / "pytorch_model.bin").read_bytes()
    _edit_manifest(
        path,
        lambda m: m["files"].update(
            {"pytorch_model.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        ),
    )


def method(
    what: str, error: type[BaseException], words: tuple[str, ...], fn: Callable[[Accelerator, Path], Any]
) -> Case:
    return Case("Accelerator methods", what, lambda d: fn(Accelerator(), d), error, words)


METHOD_CASES = [
    method(
        "accelerator.backward(1.0)",
        T,
        ("backward() takes the loss as a torch.Tensor", "got float"),
        lambda a, d: a.backward(1.0),
    ),
    method(
        "accelerator.skip_first_batches(loader, -1)",
        V,
        ("skip_first_batches.num_batches", ">= 0", "got -1"),
        lambda a, d: a.skip_first_batches(a.prepare(_loader(batch_size=2)), -1),
    ),
    method(
        "accelerator.skip_first_batches(loader, '1')",
        T,
        ("skip_first_batches.num_batches", "an integer", "'1'"),
        lambda a, d: a.skip_first_batches(a.prepare(_loader(batch_size=2)), "1"),
    ),
    method(
        "accelerator.skip_first_batches(DataLoader(...))  # not prepared",
        T,
        ("takes a dataloader returned by prepare()",),
        lambda a, d: a.skip_first_batches(_loader(batch_size=2), 1),
    ),
    method(
        "prepared_loader.set_epoch('1')",
        T,
        ("set_epoch.epoch", "an integer", "'1'"),
        lambda a, d: a.prepare(_loader(batch_size=2)).set_epoch("1"),
    ),
    method(
        "accelerator.register_for_checkpointing(object())",
        V,
        (
            "register_for_checkpointing() takes objects with state_dict() and load_state_dict() methods",
            "Item at index 0 (object)",
        ),
        lambda a, d: a.register_for_checkpointing(object()),
    ),
    method(
        "accelerator.save_state(total_limit=0)",
        V,
        ("save_state.total_limit", ">= 1", "got 0"),
        lambda a, d: a.save_state(total_limit=0),
    ),
    method(
        "accelerator.save_state()  # without project_dir",
        V,
        ("project_dir is None", "pass a directory or set project_dir"),
        lambda a, d: a.save_state(),
    ),
    method(
        "accelerator.save_state('ckpt', async_save=1)",
        T,
        ("save_state.async_save", "must be True, False or None", "got 1"),
        lambda a, d: a.save_state(str(d / "ckpt"), async_save=1),
    ),
    method(
        "accelerator.save_state(5)",
        T,
        ("save_state.output_dir", "a path (str or os.PathLike)", "got 5"),
        lambda a, d: a.save_state(5),
    ),
    method(
        "accelerator.save_state('ckpt', total_limit=2)",
        V,
        ("save_state.total_limit applies to automatically named checkpoints",),
        lambda a, d: a.save_state(str(d / "ckpt"), total_limit=2),
    ),
    method(
        "accelerator.load_state(d, weights_only='yes')",
        T,
        ("load_state.weights_only", BOOL),
        lambda a, d: a.load_state(d, weights_only="yes"),
    ),
    method(
        "accelerator.load_state('missing')",
        FileNotFoundError,
        ("load_state: no checkpoint directory at", "missing"),
        lambda a, d: a.load_state(d / "missing"),
    ),
    method(
        "accelerator.load_state(d)  # not a checkpoint",
        V,
        ("has no hasten_checkpoint.json", "not a complete hasten checkpoint"),
        lambda a, d: a.load_state(d),
    ),
    method(
        "accelerator.load_state(ckpt)  # its manifest names '../model.safetensors'",
        V,
        ("lies outside the checkpoint folder", "'../model.safetensors'", "refusing to read it"),
        lambda a, d: _tampered_load(a, d, _move_model_outside),
    ),
    method(
        "accelerator.load_state(ckpt)  # pytorch_model.bin holds a pickled object",
        UnsafeCheckpoint,
        (
            "cannot read the model weights",
            "pytorch_model.bin",
            "not a plain torch tensor file",
            "asks to load 'argparse.Namespace'",
            "nothing was loaded",
        ),
        lambda a, d: _tampered_load(a, d, _pickle_into_model, safe_serialization=False),
    ),
    method(
        "accelerator.save_model(model, d, max_shard_size='10XB')",
        V,
        ("save_model.max_shard_size", "'10GB', '500MB' or '2GiB'", "'10XB'"),
        lambda a, d: a.save_model(torch.nn.Linear(2, 2), d, max_shard_size="10XB"),
    ),
    method(
        "accelerator.reduce(tensor, 'avg')",
        V,
        ("reduction", "'sum', 'mean', 'max', 'min', 'product', 'none'", "'avg'"),
        lambda a, d: a.reduce(torch.ones(2), "avg"),
    ),
    method(
        "accelerator.autocast(autocast_handler=5)",
        T,
        ("autocast_handler must be an AutocastKwargs", "got 5"),
        lambda a, d: a.autocast(5),
    ),
    method(
        "accelerator.on_process(fn)  # no process_index",
        T,
        ("process_index is required",),
        lambda a, d: a.on_process(print),
    ),
    method(
        "accelerator.on_process(fn, process_index=-1)",
        V,
        ("on_process.process_index", ">= 0", "got -1"),
        lambda a, d: a.on_process(print, process_index=-1),
    ),
    method(
        "accelerator.on_local_process(fn, local_process_index='0')",
        T,
        ("on_local_process.local_process_index", "an integer", "'0'"),
        lambda a, d: a.on_local_process(print, local_process_index="0"),
    ),
    method(
        "accelerator.register_save_state_pre_hook('print')",
        T,
        ("register_save_state_pre_hook.hook must be a callable", "'print'"),
        lambda a, d: a.register_save_state_pre_hook("print"),
    ),
    method(
        "accelerator.register_load_state_pre_hook(None)",
        T,
        ("register_load_state_pre_hook.hook must be a callable",),
        lambda a, d: a.register_load_state_pre_hook(None),
    ),
    method(
        "accelerator.join_uneven_inputs([model], even_batches='no')",
        T,
        ("join_uneven_inputs.even_batches", "must be True, False or None", "'no'"),
        lambda a, d: a.join_uneven_inputs([], even_batches="no").__enter__(),
    ),
    method("set_seed(-1)", V, ("set_seed.seed", ">= 0 and <= 4294967295", "got -1"), lambda a, d: set_seed(-1)),
]


# ---------------------------------------------------------------------- config files and the CLI


def config_file(text: str, error: type[BaseException], *words: str) -> Case:
    def call(d: Path) -> Any:
        path = d / "c.yaml"
        path.write_text(text)
        return hasten_config.handlers_from_file(path)

    return Case("config file", text.strip().replace("\n", "⏎ "), call, error, ("<dir>/c.yaml, line", *words))


CONFIG_CASES = [
    config_file(
        "num_processes: 2\nnum_proceses: 3\n",
        V,
        "line 2",
        "unknown key 'num_proceses'",
        "did you mean 'num_processes'?",
        "launch settings num_processes, num_machines",
    ),
    config_file(
        "ddp:\n  bucket_cap: 10\n",
        V,
        "line 2",
        "unknown key 'bucket_cap'",
        "did you mean 'bucket_cap_mb'?",
        "ddp (DistributedDataParallelKwargs): dim, broadcast_buffers, bucket_cap_mb",
    ),
    config_file(
        "mixed_precision: fp4\n", V, "line 1", "mixed_precision must be one of 'no', 'fp16', 'bf16', 'fp8'", "'fp4'"
    ),
    config_file("gradient_accumulation_steps: 0\n", V, "line 1", "gradient_accumulation_steps must be >= 1", "got 0"),
    config_file("num_processes: '2'\n", T, "line 1", "num_processes must be an integer", "'2'"),
    config_file("grad_scaler:\n  init_scale: -1\n", V, "line 2", "GradScalerKwargs.init_scale must be > 0", "got -1"),
    config_file("ddp:\n  comm_hook: fp8\n", V, "line 2", "DistributedDataParallelKwargs.comm_hook", HOOKS, "'fp8'"),
    config_file("process_group:\n  timeout: soon\n", T, "line 2", "timeout must be a number", "'soon'", "(seconds)"),
    config_file(
        "process_group:\n  timeout: 1.0e+300\n",
        V,
        "line 2",
        "timeout must be >= 0.001 and <= 3153600000.0",
        "got 1e+300",
        "(seconds)",
    ),
    config_file("process_group:\n  timeout: 0.0001\n", V, "line 2", "timeout must be >= 0.001", "got 0.0001"),
    config_file("profile: [cpu]\n", T, "line 1", "section 'profile' must be a mapping of ProfileKwargs fields"),
    # Accelerate's format (it has distributed_type): what hasten does not run is refused with what to use instead
    config_file(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n",
        V,
        "line 2",
        "distributed_type DEEPSPEED: hasten does not run DeepSpeed",
        "ZeRO stage 3 is FSDP2",
        "fsdp_reshard_after_forward: true",
    ),
    config_file(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL\n",
        V,
        "line 3",
        "fsdp_sharding_strategy must be one of 'FULL_SHARD', 'SHARD_GRAD_OP'",
        "'FULL'",
    ),
]


def cli(what: str, argv: list[str], *words: str) -> Case:
    return Case(f"hasten {argv[0]}", what, lambda _d: cli_main(argv), SystemExit, ("error:", *words))


def cli_with_file(what: str, text: str, *words: str) -> Case:
    def call(d: Path) -> Any:
        (d / "c.yaml").write_text(text)
        return cli_main(["launch", "--config_file", str(d / "c.yaml"), "train.py"])

    return Case("hasten launch", what, call, SystemExit, ("error:", *words))


CLI_CASES = [
    Case(
        "hasten launch",
        "hasten launch --num_processes 4 --cpu --parallelism_config_tp_size 3 train.py",
        lambda d: (
            (d / "train.py").write_text(""),
            cli_main(
                ["launch", "--num_processes", "4", "--cpu", "--parallelism_config_tp_size", "3", str(d / "train.py")]
            ),
        ),
        SystemExit,
        ("error:", "tp_size=3", "multiplies to 3", "4 process(es)"),
    ),
    cli(
        "hasten launch --parallelism_config_dp_shard_size 0 train.py",
        ["launch", "--parallelism_config_dp_shard_size", "0", "train.py"],
        "parallelism_config_dp_shard_size",
        ">= 1",
        "got 0",
    ),
    cli(
        "hasten launch --num_processes 0 train.py",
        ["launch", "--num_processes", "0", "train.py"],
        "--num_processes",
        "num_processes must be >= 1",
        "got 0",
    ),
    cli(
        "hasten launch --num_machines 0 train.py",
        ["launch", "--num_machines", "0", "train.py"],
        "--num_machines",
        ">= 1",
        "got 0",
    ),
    cli(
        "hasten launch --machine_rank -1 train.py",
        ["launch", "--machine_rank", "-1", "train.py"],
        "--machine_rank",
        ">= 0",
        "got -1",
    ),
    cli(
        "hasten launch --max_restarts 1.5 train.py",
        ["launch", "--max_restarts", "1.5", "train.py"],
        "--max_restarts",
        "max_restarts must be an integer",
        "'1.5'",
    ),
    cli(
        "hasten launch --monitor_interval fast train.py",
        ["launch", "--monitor_interval", "fast", "train.py"],
        "--monitor_interval",
        "monitor_interval must be a number",
        "'fast'",
    ),
    cli(
        "hasten launch --main_process_port 65536 train.py",
        ["launch", "--main_process_port", "65536", "train.py"],
        "--main_process_port",
        "<= 65535",
        "got 65536",
    ),
    cli(
        "hasten launch --main_process_ip '' train.py",
        ["launch", "--main_process_ip", "", "train.py"],
        "--main_process_ip",
        "a host name or IP address",
        "''",
    ),
    cli(
        "hasten launch --num_machines 2 --machine_rank 2 --main_process_ip 10.0.0.1 train.py",
        ["launch", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "10.0.0.1", "train.py"],
        "machine_rank must be in 0 .. num_machines-1 = 1",
        "got 2",
        "from the flag",
    ),
    cli_with_file(
        "hasten launch --config_file c.yaml train.py  # c.yaml: grad_scaler: {growth_factor: 0.5}",
        "grad_scaler: {growth_factor: 0.5}\n",
        "<dir>/c.yaml, line 1",
        "GradScalerKwargs.growth_factor must be > 1",
    ),
    cli(
        "hasten launch --num_process 2 train.py",
        ["launch", "--num_process", "2", "train.py"],
        "unknown option --num_process",
        "did you mean --num_processes?",
    ),
    cli(
        "hasten launch --use_deepspeed train.py",
        ["launch", "--use_deepspeed", "train.py"],
        "--use_deepspeed is an accelerate launch flag that hasten does not implement",
        "DDP",
    ),
    cli(
        "hasten launch --num_processes 100000 train.py",
        ["launch", "--num_processes", "100000", "train.py"],
        "--num_processes 100000",
        "at most 1024 per machine",
    ),
    cli(
        "hasten launch --num_cpu_threads_per_process 0 train.py",
        ["launch", "--num_cpu_threads_per_process", "0", "train.py"],
        "--num_cpu_threads_per_process",
        "integer >= 1",
        "got 0",
    ),
    cli(
        "hasten launch --gpu_ids first train.py",
        ["launch", "--gpu_ids", "first", "train.py"],
        "--gpu_ids",
        "'all' or GPU numbers",
        "'first'",
    ),
    cli(
        "hasten launch --multi_cpu --multi_gpu train.py",
        ["launch", "--multi_cpu", "--multi_gpu", "train.py"],
        "--multi_cpu and --multi_gpu contradict each other",
    ),
    cli("hasten demo --epoch 3", ["demo", "--epoch", "3"], "unknown option --epoch", "did you mean --epochs?"),
    cli("hasten demo --num_processes 0", ["demo", "--num_processes", "0"], "--num_processes", "in 1 .. 64", "got 0"),
    cli(
        "hasten config --default --gradient_accumulation_steps 0",
        ["config", "--default", "--gradient_accumulation_steps", "0"],
        "--gradient_accumulation_steps",
        ">= 1",
        "got 0",
    ),
]


def report(what: str, setup: Callable[[Path], Any], args: list[str], *words: str) -> Case:
    """``hasten profile-report <dir> ARGS`` on the traces ``setup`` writes: exit status 2 with ``error:``."""

    def call(d: Path) -> Any:
        setup(d)
        status = cli_main(["profile-report", str(d), "--no-png", *[a.replace("<dir>", str(d)) for a in args]])
        if status:
            raise SystemExit(status)  # as the `hasten` console script does

    return Case("hasten profile-report", what, call, SystemExit, ("error:", *words))


def _trace(d: Path, events: list, name: str = "trace_rank0.json", **top: Any) -> None:
    (d / name).write_text(json.dumps({**top, "traceEvents": events}))


_MM = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1, "pid": 1, "tid": 1}
REPORT_CASES = [
    report(
        'hasten profile-report <dir>  # an event with "pid": {"a": 1}',
        lambda d: _trace(d, [{**_MM, "pid": {"a": 1}}]),
        [],
        "traceEvents[0] ('aten::mm') has pid={'a': 1}",
        "pid must be an integer or a string",
    ),
    report(
        'hasten profile-report <dir>  # an event with "dur": -1',
        lambda d: _trace(d, [{**_MM, "dur": -1}]),
        [],
        "has dur=-1",
        "dur must be a duration >= 0",
    ),
    report(
        "hasten profile-report <dir>  # trace_rank0.json -> /dev/zero",
        lambda d: (d / "trace_rank0.json").symlink_to("/dev/zero"),
        [],
        "trace_rank0.json is not a regular file (a device, a pipe or a socket behind a link)",
    ),
    report(
        "hasten profile-report <dir> --max-trace-mb 1  # a 1.4 MB trace",
        lambda d: _trace(d, [{**_MM, "ts": i} for i in range(15_000)]),
        ["--max-trace-mb", "1"],
        "MB, more than the limit of 1 MB",
        "raise the limit: --max-trace-mb 2",
    ),
    report(
        "hasten profile-report <dir> --merged <dir>/missing/m.json",
        lambda d: _trace(d, [_MM]),
        ["--merged", "<dir>/missing/m.json"],
        "cannot write the merged trace to <dir>/missing/m.json: the folder <dir>/missing does not exist",
    ),
    report(
        "hasten profile-report <dir>  # ranks 0 and 1 from runs of 2 and 3 processes",
        lambda d: [
            _trace(d, [_MM], f"trace_rank{r}.json", distributedInfo={"rank": r, "world_size": w})
            for r, w in ((0, 2), (1, 3))
        ],
        [],
        "traces of different runs are mixed",
        "world sizes differ",
        "keep one run's files in the folder",
    ),
    report(
        "hasten profile-report <dir> --max-trace-mb 0",
        lambda d: None,
        ["--max-trace-mb", "0"],
        "--max-trace-mb: must be a number of MB > 0, got '0'",
    ),
]

CASES: list[Case] = [
    *HANDLER_CASES,
    *OPTION_CASES,
    *ACCELERATOR_CASES,
    *ENV_CASES,
    *PREPARE_CASES,
    *DATA_CASES,
    *COMPAT_CASES,
    *METHOD_CASES,
    *CONFIG_CASES,
    *CLI_CASES,
    *REPORT_CASES,
]


# ---------------------------------------------------------------------- running a case

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def isolated(folder: Path) -> Iterator[io.StringIO]:
    """No launcher or HASTEN_* variables, the config home in ``folder``, stderr captured."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("HASTEN_", "TORCHELASTIC_")) or key in _LAUNCH_VARS:
            del os.environ[key]
    os.environ["HASTEN_CONFIG_HOME"] = str(folder / "config-home")
    stream = io.StringIO()
    try:
        with contextlib.redirect_stderr(stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield stream
    finally:
        os.environ.clear()
        os.environ.update(saved)


def refusal(case: Case, folder: Path) -> tuple[type[BaseException], str]:
    """Run ``case`` in ``folder``: the error it raised and its message (``folder`` written ``<dir>``).

    For argparse (``SystemExit``) the message is the ``error:`` line it printed; any other
    exit status is returned as an AssertionError so that the test fails and says so.
    """
    folder = folder.resolve()
    with isolated(folder) as stderr:
        try:
            case.call(folder)
        except SystemExit as exc:
            lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
            if exc.code != 2 or not lines:
                return AssertionError, f"exit status {exc.code!r}, stderr: {stderr.getvalue()!r}"
            message = lines[-1]
            error: type[BaseException] = SystemExit
        except Exception as exc:  # noqa: BLE001 - the test compares the type with the expected one
            message, error = str(exc), type(exc)
        else:
            return AssertionError, "accepted"
    return error, message.replace(str(folder), "<dir>")


@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input_is_refused_at_entry(case, tmp_path):
    error, message = refusal(case, tmp_path)
    assert error is case.error, f"{case.what}: expected {case.error.__name__}, got {error.__name__}: {message}"
    missing = [w for w in case.words if w not in message]
    assert not missing, f"{case.what}: {missing} not in the message {message!r}"


def test_every_handler_field_has_a_wrong_type_and_an_out_of_range_row():
    for cls in HANDLERS:
        rows = [c for c in HANDLER_CASES if c.entry == cls.__name__]
        for f in dataclasses.fields(cls):
            errors = {c.error for c in rows if c.field == f.name}
            assert TypeError in errors, f"{cls.__name__}.{f.name} has no wrong-type row"
            if f.type not in ("bool", "bool | None") and f.name not in NO_RANGE:
                assert ValueError in errors, f"{cls.__name__}.{f.name} has no out-of-range row"


def test_fewer_batches_than_processes_is_refused_on_every_rank(tmp_path):
    """Both ranks refuse with the same message: no rank goes on alone into a collective."""
    messages = {refusal(c, tmp_path) for c in DATA_CASES if "even_batches=False" in c.what}
    assert len(messages) == 1


def test_errors_doc_is_current():
    import gen_errors_doc

    expected = gen_errors_doc.render()
    assert DOC.is_file(), "docs/errors.md is missing: run `python tests/gen_errors_doc.py`"
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/errors.md is stale: run `python tests/gen_errors_doc.py` and commit the result"
    )
