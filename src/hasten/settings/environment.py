"""Every environment variable hasten reads or exports: its name, what it is for, and the one
place that reads it or writes it.

No other module of hasten touches ``os.environ``: each imports the name from here and calls a
reader (:func:`get`, :func:`env_text`, :func:`env_flag`, :func:`env_int`, :func:`env_rank`) or a
writer (:func:`export`, :func:`export_default`, :func:`patched`, :func:`cleared`, :func:`kept`).
Each constant is spelled as the variable it names, so ``grep HASTEN_USE_CPU`` finds its
definition and every use.

The variables are read where a setting enters (``Accelerator(...)``, a plugin's construction,
``hasten launch``), never per training step. Pure Python, no torch: the CLI imports it at start-up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TypeVar

from hasten import _validate as v

_T = TypeVar("_T")

# ----------------------------------------------------------------------------- set by the launcher
# torch.distributed.run (and so ``hasten launch`` and torchrun) sets these in every worker;
# ``debug_launcher`` sets the first seven itself. Read by ``ProcessState`` and the worker wrapper.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
#: the attempt number (restarts of the worker group) and the most attempts allowed
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: "True" when the workers share the elastic agent's store
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: where a failing worker writes its error (the launcher's log folder)
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"

# ----------------------------------------------------------------------------- hasten's own
# ``hasten launch`` exports the settings it was given; an ``Accelerator()`` whose argument was not
# passed in code reads them.
PREFIX = "HASTEN_"
HASTEN_MIXED_PRECISION = "HASTEN_MIXED_PRECISION"
HASTEN_GRADIENT_ACCUMULATION_STEPS = "HASTEN_GRADIENT_ACCUMULATION_STEPS"
HASTEN_USE_CPU = "HASTEN_USE_CPU"
HASTEN_USE_FSDP = "HASTEN_USE_FSDP"
HASTEN_USE_PARALLELISM_CONFIG = "HASTEN_USE_PARALLELISM_CONFIG"
HASTEN_DYNAMO_BACKEND = "HASTEN_DYNAMO_BACKEND"
HASTEN_DYNAMO_MODE = "HASTEN_DYNAMO_MODE"
HASTEN_DYNAMO_USE_FULLGRAPH = "HASTEN_DYNAMO_USE_FULLGRAPH"
HASTEN_DYNAMO_USE_DYNAMIC = "HASTEN_DYNAMO_USE_DYNAMIC"
HASTEN_DYNAMO_USE_REGIONAL_COMPILATION = "HASTEN_DYNAMO_USE_REGIONAL_COMPILATION"
#: the config file ``hasten launch`` used (the Accelerator builds its handler sections)
HASTEN_CONFIG_FILE = "HASTEN_CONFIG_FILE"
#: the variables ``hasten launch`` set from the config file (comma-separated): code overrides them silently
HASTEN_FROM_CONFIG_FILE = "HASTEN_FROM_CONFIG_FILE"
#: the folder of the default config file (else $XDG_CACHE_HOME/hasten)
HASTEN_CONFIG_HOME = "HASTEN_CONFIG_HOME"
#: the level of loggers from ``get_logger`` built without ``log_level``
HASTEN_LOG_LEVEL = "HASTEN_LOG_LEVEL"
#: this process's device (``cuda:1``)
HASTEN_TORCH_DEVICE = "HASTEN_TORCH_DEVICE"
#: check that collectives get matching shapes on every rank (slow; for debugging)
HASTEN_DEBUG_MODE = "HASTEN_DEBUG_MODE"
#: the launcher's process id, exported to its workers so they die with it
HASTEN_LAUNCHER_PID = "HASTEN_LAUNCHER_PID"
#: "1": every worker of ``hasten launch`` installs hasten as ``accelerate`` before its script runs
#: (``--as_accelerate``; read by the worker wrapper, ``hasten.cli._child``)
HASTEN_AS_ACCELERATE = "HASTEN_AS_ACCELERATE"
#: fault tolerance (``hasten launch --ft_*``; read by ``FaultToleranceKwargs.resolved``): the lighthouse's
#: address, this launch's replica group and the number of groups
HASTEN_FT_LIGHTHOUSE = "HASTEN_FT_LIGHTHOUSE"
HASTEN_FT_REPLICA_GROUP = "HASTEN_FT_REPLICA_GROUP"
HASTEN_FT_NUM_REPLICA_GROUPS = "HASTEN_FT_NUM_REPLICA_GROUPS"
#: torchft's own name for the lighthouse's address (read after HASTEN_FT_LIGHTHOUSE)
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"

# ----------------------------------------------------------------------------- Accelerate's spellings
# What ``accelerate launch`` sets (and what libraries such as transformers read); hasten reads
# each after its own HASTEN_* name.
ACCELERATE_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
ACCELERATE_TORCH_DEVICE = "ACCELERATE_TORCH_DEVICE"
ACCELERATE_DEBUG_MODE = "ACCELERATE_DEBUG_MODE"
#: ``init_empty_weights(include_buffers=None)``'s default
ACCELERATE_INIT_INCLUDE_BUFFERS = "ACCELERATE_INIT_INCLUDE_BUFFERS"
#: ``hasten launch --use_fsdp`` exports it too: transformers' ``from_pretrained`` reads it
ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"
#: ``hasten launch --use_parallelism_config`` (or a size) exports it; ``ParallelismConfig.from_env`` reads it
ACCELERATE_USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"
ACCELERATE_DYNAMO_BACKEND = "ACCELERATE_DYNAMO_BACKEND"
ACCELERATE_DYNAMO_MODE = "ACCELERATE_DYNAMO_MODE"
ACCELERATE_DYNAMO_USE_FULLGRAPH = "ACCELERATE_DYNAMO_USE_FULLGRAPH"
ACCELERATE_DYNAMO_USE_DYNAMIC = "ACCELERATE_DYNAMO_USE_DYNAMIC"
ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"

#: whether to build an FSDP plugin from the environment: hasten's name, then Accelerate's
USE_FSDP = (HASTEN_USE_FSDP, ACCELERATE_USE_FSDP)
#: TorchDynamoPlugin field -> (hasten's name, Accelerate's name), read in that order
DYNAMO_FIELDS: dict[str, tuple[str, str]] = {
    "backend": (HASTEN_DYNAMO_BACKEND, ACCELERATE_DYNAMO_BACKEND),
    "mode": (HASTEN_DYNAMO_MODE, ACCELERATE_DYNAMO_MODE),
    "fullgraph": (HASTEN_DYNAMO_USE_FULLGRAPH, ACCELERATE_DYNAMO_USE_FULLGRAPH),
    "use_regional_compilation": (HASTEN_DYNAMO_USE_REGIONAL_COMPILATION, ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION),
    "dynamic": (HASTEN_DYNAMO_USE_DYNAMIC, ACCELERATE_DYNAMO_USE_DYNAMIC),
}

# ----------------------------------------------------------------------------- fp8 recipes
# Accelerate's names for the fp8 recipe handlers' defaults (``accelerate launch --fp8_*`` and the
# config file's ``fp8_config:`` set them; ``hasten launch`` sets the same). A handler field left
# None reads its variable when the handler is built (hasten.settings.recipes).
#: the fp8 library: AO (torchao), TE (Transformer Engine) or MSAMP; FP8RecipeKwargs.backend's default, and
#: the backend an Accelerator(mixed_precision="fp8") built without a recipe handler uses
ACCELERATE_FP8_BACKEND = "ACCELERATE_FP8_BACKEND"
#: AORecipeKwargs: pad the inner dimension of fp8 matmuls to a multiple of 16 (default true)
ACCELERATE_FP8_PAD_INNER_DIM = "ACCELERATE_FP8_PAD_INNER_DIM"
#: AORecipeKwargs: FSDP2 all-gathers fp8 weights (default true)
ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER = "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"
#: TERecipeKwargs: fp8 autocast in eval mode too (default false)
ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL = "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL"
#: TERecipeKwargs: the scaling factor's margin (default 0)
ACCELERATE_FP8_MARGIN = "ACCELERATE_FP8_MARGIN"
#: TERecipeKwargs: steps between recomputations of the scaling factor (default 1)
ACCELERATE_FP8_INTERVAL = "ACCELERATE_FP8_INTERVAL"
#: TERecipeKwargs: the fp8 format, HYBRID, E4M3 or E5M2 (default HYBRID)
ACCELERATE_FP8_FORMAT = "ACCELERATE_FP8_FORMAT"
#: TERecipeKwargs: the amax history's length (default 1024)
ACCELERATE_FP8_AMAX_HISTORY_LEN = "ACCELERATE_FP8_AMAX_HISTORY_LEN"
#: TERecipeKwargs: how the amax is computed from its history, max or most_recent (default most_recent)
ACCELERATE_FP8_AMAX_COMPUTE_ALGO = "ACCELERATE_FP8_AMAX_COMPUTE_ALGO"
#: TERecipeKwargs.override_linear_precision: the fprop, dgrad and wgrad matmuls in higher precision
ACCELERATE_FP8_OVERRIDE_FPROP = "ACCELERATE_FP8_OVERRIDE_FPROP"
ACCELERATE_FP8_OVERRIDE_DGRAD = "ACCELERATE_FP8_OVERRIDE_DGRAD"
ACCELERATE_FP8_OVERRIDE_WGRAD = "ACCELERATE_FP8_OVERRIDE_WGRAD"
#: TERecipeKwargs: Transformer Engine's MXFP8 block scaling (default false)
ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING = "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING"
#: MSAMPRecipeKwargs: MS-AMP's optimisation level, O1 or O2 (default O2)
ACCELERATE_FP8_OPT_LEVEL = "ACCELERATE_FP8_OPT_LEVEL"
#: the three variables of TERecipeKwargs.override_linear_precision, in its order
FP8_OVERRIDE_LINEAR_PRECISION = (
    ACCELERATE_FP8_OVERRIDE_FPROP,
    ACCELERATE_FP8_OVERRIDE_DGRAD,
    ACCELERATE_FP8_OVERRIDE_WGRAD,
)

# ----------------------------------------------------------------------------- plugin variables
# Accelerate's names for the FSDP plugin's and the ParallelismConfig's defaults (what
# ``accelerate launch --fsdp_* / --parallelism_config_*`` sets; ``hasten launch`` sets the same).
FSDP_VERSION = "FSDP_VERSION"
FSDP_RESHARD_AFTER_FORWARD = "FSDP_RESHARD_AFTER_FORWARD"
FSDP_OFFLOAD_PARAMS = "FSDP_OFFLOAD_PARAMS"
FSDP_AUTO_WRAP_POLICY = "FSDP_AUTO_WRAP_POLICY"
FSDP_TRANSFORMER_CLS_TO_WRAP = "FSDP_TRANSFORMER_CLS_TO_WRAP"
FSDP_MIN_NUM_PARAMS = "FSDP_MIN_NUM_PARAMS"
FSDP_STATE_DICT_TYPE = "FSDP_STATE_DICT_TYPE"
FSDP_ACTIVATION_CHECKPOINTING = "FSDP_ACTIVATION_CHECKPOINTING"
FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD = "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"
FSDP_CPU_RAM_EFFICIENT_LOADING = "FSDP_CPU_RAM_EFFICIENT_LOADING"
#: a regular expression of module names whose parameters are not sharded (Accelerate's fsdp_ignored_modules)
FSDP_IGNORED_MODULES = "FSDP_IGNORED_MODULES"
#: FSDP1's settings, read by ``hasten launch`` (--fsdp_sharding_strategy, ...), which maps them to FSDP2's
#: (hasten.settings.accelerate_config.apply_fsdp1); no Accelerator reads them
FSDP_SHARDING_STRATEGY = "FSDP_SHARDING_STRATEGY"
FSDP_BACKWARD_PREFETCH = "FSDP_BACKWARD_PREFETCH"
FSDP_FORWARD_PREFETCH = "FSDP_FORWARD_PREFETCH"
FSDP_USE_ORIG_PARAMS = "FSDP_USE_ORIG_PARAMS"
FSDP_SYNC_MODULE_STATES = "FSDP_SYNC_MODULE_STATES"
#: FullyShardedDataParallelPlugin field -> its variable
FSDP_FIELDS: dict[str, str] = {
    "fsdp_version": FSDP_VERSION,
    "reshard_after_forward": FSDP_RESHARD_AFTER_FORWARD,
    "cpu_offload": FSDP_OFFLOAD_PARAMS,
    "auto_wrap_policy": FSDP_AUTO_WRAP_POLICY,
    "transformer_cls_names_to_wrap": FSDP_TRANSFORMER_CLS_TO_WRAP,
    "min_num_params": FSDP_MIN_NUM_PARAMS,
    "state_dict_type": FSDP_STATE_DICT_TYPE,
    "activation_checkpointing": FSDP_ACTIVATION_CHECKPOINTING,
    "activation_checkpointing_offload": FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
    "cpu_ram_efficient_loading": FSDP_CPU_RAM_EFFICIENT_LOADING,
    "ignored_modules": FSDP_IGNORED_MODULES,
}
PARALLELISM_CONFIG_DP_REPLICATE_SIZE = "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"
PARALLELISM_CONFIG_DP_SHARD_SIZE = "PARALLELISM_CONFIG_DP_SHARD_SIZE"
PARALLELISM_CONFIG_TP_SIZE = "PARALLELISM_CONFIG_TP_SIZE"
PARALLELISM_CONFIG_CP_SIZE = "PARALLELISM_CONFIG_CP_SIZE"
PARALLELISM_CONFIG_CP_BACKEND = "PARALLELISM_CONFIG_CP_BACKEND"
PARALLELISM_CONFIG_CP_COMM_STRATEGY = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"
#: sequence parallelism (Ulysses): its size, and the backend ("torch"; Accelerate's "deepspeed" is refused)
PARALLELISM_CONFIG_SP_SIZE = "PARALLELISM_CONFIG_SP_SIZE"
PARALLELISM_CONFIG_SP_BACKEND = "PARALLELISM_CONFIG_SP_BACKEND"
PARALLELISM_CONFIG_PP_SIZE = "PARALLELISM_CONFIG_PP_SIZE"
#: hasten's: expert parallelism's size (carved out of dp_shard)
PARALLELISM_CONFIG_EP_SIZE = "PARALLELISM_CONFIG_EP_SIZE"
#: hasten's: TorchPipelineParallelConfig's schedule and microbatches, from ``hasten launch``
PARALLELISM_CONFIG_PP_SCHEDULE = "PARALLELISM_CONFIG_PP_SCHEDULE"
PARALLELISM_CONFIG_PP_MICROBATCHES = "PARALLELISM_CONFIG_PP_MICROBATCHES"
#: ParallelismConfig field -> its variable
PARALLELISM_SIZES: dict[str, str] = {
    "pp_size": PARALLELISM_CONFIG_PP_SIZE,
    "dp_replicate_size": PARALLELISM_CONFIG_DP_REPLICATE_SIZE,
    "dp_shard_size": PARALLELISM_CONFIG_DP_SHARD_SIZE,
    "tp_size": PARALLELISM_CONFIG_TP_SIZE,
    "cp_size": PARALLELISM_CONFIG_CP_SIZE,
    "sp_size": PARALLELISM_CONFIG_SP_SIZE,
    "ep_size": PARALLELISM_CONFIG_EP_SIZE,
}

# ----------------------------------------------------------------------------- third-party
#: torch's: "1" gives each rendezvous round a store of its own (``hasten launch`` sets it with c10d
#: on several machines unless the user did)
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: Kineto's: set, the profiler is driven by the Kineto daemon (hasten's quiet schedule stays off)
KINETO_USE_DAEMON = "KINETO_USE_DAEMON"
#: Kineto's log level (``hasten launch`` sets 6, quiet, unless the user did)
KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
#: OpenMP's threads per process (``hasten launch`` sets cores / processes unless the user did)
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: CUDA's visible GPUs (``hasten launch --gpu_ids`` sets it)
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: the XDG base directory of caches (the default config file's folder is under it)
XDG_CACHE_HOME = "XDG_CACHE_HOME"
#: Hugging Face's cache folder: Accelerate's default config file is ``$HF_HOME/accelerate/default_config.yaml``
#: (else ``$XDG_CACHE_HOME/huggingface/...``), which ``hasten launch`` reads when hasten has none
HF_HOME = "HF_HOME"
#: what a SLURM step (``srun``) tells ``hasten launch``
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_STEPID = "SLURM_STEPID"
SLURM_NNODES = "SLURM_NNODES"
SLURM_NODEID = "SLURM_NODEID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_NODELIST = "SLURM_NODELIST"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
#: torchrun's own variables (``PET_<flag>``), in which Kubeflow Trainer's PyTorch runtime describes the job
PET_NNODES = "PET_NNODES"
PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
PET_NODE_RANK = "PET_NODE_RANK"
PET_MASTER_ADDR = "PET_MASTER_ADDR"
PET_MASTER_PORT = "PET_MASTER_PORT"
#: the trackers' own variables, which Accelerate's MLflow and ClearML trackers read too
MLFLOW_TAGS = "MLFLOW_TAGS"
MLFLOW_EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
MLFLOW_NESTED_RUN = "MLFLOW_NESTED_RUN"
CLEARML_PROJECT = "CLEARML_PROJECT"
CLEARML_TASK = "CLEARML_TASK"


# ----------------------------------------------------------------------------- readers


def current() -> Mapping[str, str]:
    """This process's environment, for code that reads a mapping it may also be given in a test."""
    return os.environ


def get(name: str, default: _T | None = None) -> str | _T | None:
    """The variable's text as it is (``""`` when set empty), else ``default``."""
    return os.environ.get(name, default)


def require(name: str) -> str:
    """The variable's text; a KeyError naming it when it is unset."""
    return os.environ[name]


def is_set(name: str) -> bool:
    """Whether the variable is set (to anything, ``""`` included)."""
    return name in os.environ


def env_text(*names: str) -> str | None:
    """The text of the first of these variables that is set and not empty (hasten's name, then
    Accelerate's), else None."""
    for name in names:
        raw = os.environ.get(name)
        if raw not in (None, ""):
            return raw
    return None


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean variable ``name`` (1/0, true/false, yes/no, on/off, any case); unset or empty
    gives ``default``; other text is a ValueError naming the variable and the spellings."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    return v.parse_bool_text(f"environment variable {name}", raw)


def env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The integer variable ``name``; unset or empty gives ``default``; other text is a ValueError."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    return v.parse_int_text(f"environment variable {name}", raw)


def env_rank() -> int:
    """``RANK`` as the launcher set it, 0 when unset or not a number (for messages and logging
    before, or without, a process group; ``ProcessState`` reads it strictly)."""
    raw = os.environ.get(RANK, "0")
    return int(raw) if raw.strip().isdigit() else 0


def with_prefix(prefix: str) -> dict[str, str]:
    """Every variable whose name starts with ``prefix``, sorted by name."""
    return dict(sorted((k, val) for k, val in os.environ.items() if k.startswith(prefix)))


# ----------------------------------------------------------------------------- writers


def export(values: Mapping[str, str]) -> None:
    """Set these variables in this process (and so in the processes it starts)."""
    os.environ.update(values)


def unset(*names: str) -> None:
    """Remove these variables from this process's environment (and so its children's)."""
    for name in names:
        os.environ.pop(name, None)


def export_default(name: str, value: str) -> str:
    """Set ``name`` to ``value`` unless it is set already (the user's value wins); return its value."""
    return os.environ.setdefault(name, value)


@contextlib.contextmanager
def patched(values: Mapping[str, str]) -> Iterator[None]:
    """Set these variables for the ``with`` block, then restore each (unset again if it was)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


@contextlib.contextmanager
def cleared() -> Iterator[None]:
    """Empty this process's environment for the ``with`` block, then put back exactly what it held
    (variables set inside the block are dropped, changed ones restored)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def kept(prefixes: tuple[str, ...]) -> Iterator[None]:
    """After the ``with`` block, the variables whose names start with one of ``prefixes`` are as
    they were before it: those it set are unset, those it changed or unset are restored."""
    saved = {k: val for k, val in os.environ.items() if k.startswith(prefixes)}
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith(prefixes) and k not in saved]:
            del os.environ[k]
        os.environ.update(saved)
