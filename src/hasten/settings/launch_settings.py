"""The launcher's settings table: every launch setting (``num_processes``, ``mixed_precision``,
...) with its flag, its ``HASTEN_*`` environment variable, its default and the check its value
passes, and the checks that involve several settings.

``hasten launch`` (flags), the config file (:mod:`hasten.settings.config_file`) and the environment
all go through this table, so a value is checked by the same rule wherever it comes from. Pure
Python: torch is never imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.choices import (
    AMAX_COMPUTE_ALGOS,
    DYNAMO_MODES,
    FP8_FORMATS,
    MIXED_PRECISION_CHOICES,
    OPT_LEVELS,
    RDZV_BACKENDS,
)
from hasten.settings.fault_tolerance import check_lighthouse
from hasten.settings.pipeline import PIPELINE_SCHEDULES
from hasten.settings.plugins import (  # FSDP1's strategies: one list, for code and files
    FSDP_SHARDING_STRATEGIES,
    sharding_strategy_name,
)
from hasten.settings.plugins import FSDP_STATE_DICT_TYPES as FSDP_STATE_DICT_CHOICES
from hasten.settings.plugins import FSDP_WRAP_POLICIES as FSDP_WRAP_POLICY_CHOICES


def _mixed_precision(value: Any) -> str:
    if value is False:  # YAML 1.1 reads a bare `no` as false
        value = "no"
    return v.check_choice(
        "", "mixed_precision", value.lower() if isinstance(value, str) else value, MIXED_PRECISION_CHOICES
    )


def _dynamo_backend(value: Any) -> str:
    """A backend name, lower-cased; the Accelerator checks it against torch's registered backends
    (the launcher does not import torch)."""
    if value is False:  # YAML 1.1 reads a bare `no` as false
        value = "no"
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value.strip()):
        raise ValueError(
            f"dynamo_backend must be a backend name such as 'inductor', 'aot_eager' or 'no', got {v.shown(value)}"
        )
    return value.strip().lower()


def _bool_text(name: str) -> Callable[[Any], str]:
    """A true/false setting that Accelerate's launcher takes as a value (``--fsdp_offload_params true``)."""

    def check(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if not isinstance(value, str):
            raise TypeError(f"{name} must be true or false, got {v.shown(value)}")
        return "true" if v.parse_bool_text(name, value) else "false"

    return check


#: FSDP1's backward prefetch policies (FSDP2 prefetches by itself)
FSDP_BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


def _sharding_strategy(value: Any) -> str:
    name = sharding_strategy_name(value)
    if name is None:
        raise ValueError(
            f"fsdp_sharding_strategy must be one of {', '.join(map(repr, FSDP_SHARDING_STRATEGIES))} (or torch's "
            f"number of one, 1 to 5), got {v.shown(value)}"
        )
    return name


def _backward_prefetch(value: Any) -> str:
    text = value.strip().upper().rsplit(".", 1)[-1] if isinstance(value, str) else value
    return v.check_choice("", "fsdp_backward_prefetch", text, FSDP_BACKWARD_PREFETCHES)


def _ignored_modules(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError(
            f"fsdp_ignored_modules must be a regular expression matched against module names, got {v.shown(value)}"
        )
    try:
        re.compile(value.strip())
    except re.error as err:
        raise ValueError(f"fsdp_ignored_modules={v.shown(value)} is not a regular expression: {err}") from None
    return value.strip()


def _reshard(value: Any) -> str:
    strategy = sharding_strategy_name(value, numbers=False)
    if strategy is not None:  # FSDP1's spelling (Accelerate 1.6+ writes the strategy here): see apply_fsdp1
        return strategy
    text = str(value).strip()
    if text.isdigit() and int(text) >= 2:
        return text
    return _bool_text("fsdp_reshard_after_forward")(value if isinstance(value, (bool, str)) else text)


def _class_names(value: Any) -> str:
    names = value if isinstance(value, list) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    if not names or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap must be class names separated by commas, got {v.shown(value)}"
        )
    return ",".join(names)


def _folded_choice(name: str, choices: tuple[str, ...], fold: Callable[[str], str]) -> Callable[[Any], str]:
    """One of ``choices`` in any case, kept as ``fold`` spells it (``--fp8_format hybrid`` is HYBRID)."""

    def check(value: Any) -> str:
        folded = fold(value.strip()) if isinstance(value, str) else None
        return v.check_choice("", name, folded if folded in choices else value, choices)

    return check


def _linear_precision(value: Any) -> str:
    """Three booleans (fprop, dgrad, wgrad): ``true,false,false`` as Accelerate's flag takes it, or a
    YAML list; kept as ``true,false,false``."""
    if isinstance(value, str):  # `accelerate config` writes a Python tuple: "(false, false, true)"
        value = value.strip().removeprefix("(").removesuffix(")").removeprefix("[").removesuffix("]")
    parts = value if isinstance(value, (list, tuple)) else value.split(",") if isinstance(value, str) else None
    if parts is None or len(parts) != 3:
        raise ValueError(
            "fp8_override_linear_precision must be three booleans (fprop, dgrad, wgrad) such as 'false,false,true' "
            f"or [false, false, true], got {v.shown(value)}"
        )
    check = _bool_text("fp8_override_linear_precision")
    return ",".join(check(p.strip() if isinstance(p, str) else p) for p in parts)


def _schedule_name(text: str) -> str:
    """A pipeline schedule's name as torch spells it (``gpipe`` is GPipe); other text unchanged."""
    return {name.lower(): name for name in PIPELINE_SCHEDULES}.get(text.lower(), text)


# FP8_BACKENDS without NO: the launcher names a library (NO is the unset variable)
_FP8_LIBRARIES = ("AO", "TE", "MSAMP")

# The config file's `dynamo:` section (and Accelerate's `dynamo_config:`), as launch settings.
DYNAMO_SECTION_KEYS = ("backend", "mode", "use_fullgraph", "use_dynamic", "use_regional_compilation")


def _ip(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"main_process_ip must be a host name or IP address such as '10.0.0.1', got {v.shown(value)}")
    return value.strip()


def _rdzv_conf(value: Any) -> str:
    """``key=value[,key=value...]`` as torch.distributed.run's --rdzv-conf takes it."""
    if not isinstance(value, str) or not value.strip():
        raise TypeError(
            f"rdzv_conf must be key=value pairs separated by commas such as 'join_timeout=600', got {v.shown(value)}"
        )
    for part in value.strip().split(","):
        key, eq, val = part.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()) or not val.strip():
            raise ValueError(
                f"rdzv_conf must be key=value pairs separated by commas such as 'join_timeout=600,"
                f"read_timeout=60', got {v.shown(value)} (bad part {v.shown(part)})"
            )
    return value.strip()


@dataclass(frozen=True)
class LaunchSetting:
    """One launch setting: its type, its check (shared by the CLI and the config file), its help."""

    name: str
    kind: type  # int, float, str or bool: how a CLI string is parsed
    check: Callable[[Any], Any]
    help: str
    env: str | None = None  # environment variable that carries it to the Accelerator
    default: Any = None  # None: not set (the launcher decides)


def _int(name: str, **bounds: int) -> Callable[[Any], int]:
    return lambda value: v.check_number("", name, value, integer=True, **bounds)


LAUNCH_SETTINGS: dict[str, LaunchSetting] = {
    s.name: s
    for s in (
        LaunchSetting(
            "num_processes",
            int,
            _int("num_processes", ge=1),
            "total number of processes across all machines (default: one per GPU, or 1 without GPUs)",
        ),
        LaunchSetting("num_machines", int, _int("num_machines", ge=1), "number of machines", default=1),
        LaunchSetting(
            "machine_rank", int, _int("machine_rank", ge=0), "rank of this machine, 0 .. num_machines-1", default=0
        ),
        LaunchSetting(
            "main_process_ip", str, _ip, "address of the machine with machine_rank 0 (needed with several machines)"
        ),
        LaunchSetting(
            "main_process_port",
            int,
            _int("main_process_port", ge=1, le=65535),
            "port on the main machine (default: a free port on one machine, 29500 on several)",
        ),
        LaunchSetting(
            "rdzv_backend",
            str,
            lambda value: v.check_choice("", "rdzv_backend", value, RDZV_BACKENDS),
            "rendezvous of torch.distributed.run: 'static' (machine ranks as given) or 'c10d'",
            default="static",
        ),
        LaunchSetting(
            "max_machines",
            int,
            _int("max_machines", ge=1),
            "elastic: the most machines that may join (num_machines is then the fewest; needs rdzv_backend c10d)",
        ),
        LaunchSetting(
            "rdzv_conf",
            str,
            _rdzv_conf,
            "extra rendezvous options of torch.distributed.run, key=value[,key=value...] (e.g. join_timeout=600)",
        ),
        LaunchSetting(
            "max_restarts", int, _int("max_restarts", ge=0), "restarts of the whole worker group on failure", default=0
        ),
        LaunchSetting(
            "monitor_interval",
            float,
            lambda value: v.check_number("", "monitor_interval", value, gt=0),
            "seconds between the launcher's checks of its workers",
            default=0.1,
        ),
        LaunchSetting(
            "cpu",
            bool,
            lambda value: v.check_bool("", "cpu", value),
            "train on CPU (gloo) even when GPUs are present",
            env=env.HASTEN_USE_CPU,
            default=False,
        ),
        LaunchSetting(
            "as_accelerate",
            bool,
            lambda value: v.check_bool("", "as_accelerate", value),
            "install hasten as `accelerate` in every process before the script runs (hasten.install_as_accelerate: "
            "transformers', TRL's, PEFT's and diffusers' `import accelerate` get hasten)",
            env=env.HASTEN_AS_ACCELERATE,
            default=False,
        ),
        LaunchSetting(
            "mixed_precision",
            str,
            _mixed_precision,
            "mixed precision of an Accelerator() built without mixed_precision=",
            env=env.HASTEN_MIXED_PRECISION,
            default="no",
        ),
        LaunchSetting(
            "dynamo_backend",
            str,
            _dynamo_backend,
            "torch.compile backend of an Accelerator() built without dynamo_backend=/dynamo_plugin= "
            "('inductor', 'aot_eager', 'eager', ... or 'no')",
            env=env.HASTEN_DYNAMO_BACKEND,
        ),
        LaunchSetting(
            "dynamo_mode",
            str,
            lambda value: v.check_choice("", "dynamo_mode", value, DYNAMO_MODES),
            "torch.compile mode",
            env=env.HASTEN_DYNAMO_MODE,
        ),
        LaunchSetting(
            "dynamo_use_fullgraph",
            bool,
            lambda value: v.check_bool("", "dynamo_use_fullgraph", value),
            "torch.compile(fullgraph=True): one graph for the whole model, an error at a graph break",
            env=env.HASTEN_DYNAMO_USE_FULLGRAPH,
        ),
        LaunchSetting(
            "dynamo_use_dynamic",
            bool,
            lambda value: v.check_bool("", "dynamo_use_dynamic", value),
            "torch.compile(dynamic=True): compile for dynamic shapes from the start",
            env=env.HASTEN_DYNAMO_USE_DYNAMIC,
        ),
        LaunchSetting(
            "dynamo_use_regional_compilation",
            bool,
            lambda value: v.check_bool("", "dynamo_use_regional_compilation", value),
            "compile each repeated block (e.g. transformer layers) instead of the whole model",
            env=env.HASTEN_DYNAMO_USE_REGIONAL_COMPILATION,
        ),
        LaunchSetting(
            "use_fsdp",
            bool,
            lambda value: v.check_bool("", "use_fsdp", value),
            "shard with FSDP2 (an Accelerator() built without fsdp_plugin= builds one from the --fsdp_* settings)",
            env=env.HASTEN_USE_FSDP,
        ),
        LaunchSetting(
            "fsdp_version",
            int,
            _int("fsdp_version", ge=1, le=2),
            "FSDP version: 2 (hasten implements FSDP2)",
            env=env.FSDP_VERSION,
        ),
        LaunchSetting(
            "fsdp_auto_wrap_policy",
            str,
            lambda value: v.check_choice("", "fsdp_auto_wrap_policy", str(value).lower(), FSDP_WRAP_POLICY_CHOICES),
            "which submodules are sharded as units: transformer_based_wrap, size_based_wrap or no_wrap",
            env=env.FSDP_AUTO_WRAP_POLICY,
        ),
        LaunchSetting(
            "fsdp_transformer_layer_cls_to_wrap",
            str,
            _class_names,
            "class names of the blocks to shard (comma-separated), with transformer_based_wrap",
            env=env.FSDP_TRANSFORMER_CLS_TO_WRAP,
        ),
        LaunchSetting(
            "fsdp_min_num_params",
            int,
            _int("fsdp_min_num_params", ge=0),
            "parameters a submodule needs to be sharded on its own, with size_based_wrap",
            env=env.FSDP_MIN_NUM_PARAMS,
        ),
        LaunchSetting(
            "fsdp_reshard_after_forward",
            str,
            _reshard,
            "free the gathered parameters after forward: true, false or a group size >= 2 (an FSDP1 sharding "
            "strategy, FULL_SHARD, ..., is read as --fsdp_sharding_strategy)",
            env=env.FSDP_RESHARD_AFTER_FORWARD,
        ),
        LaunchSetting(
            "fsdp_offload_params",
            str,
            _bool_text("fsdp_offload_params"),
            "keep parameters, gradients and optimizer state on the CPU (true/false)",
            env=env.FSDP_OFFLOAD_PARAMS,
        ),
        LaunchSetting(
            "fsdp_state_dict_type",
            str,
            lambda value: v.check_choice("", "fsdp_state_dict_type", str(value).upper(), FSDP_STATE_DICT_CHOICES),
            "checkpoints: SHARDED_STATE_DICT (each process its shards, reloadable at another size) or FULL_STATE_DICT",
            env=env.FSDP_STATE_DICT_TYPE,
        ),
        LaunchSetting(
            "fsdp_activation_checkpointing",
            str,
            _bool_text("fsdp_activation_checkpointing"),
            "recompute each sharded block's activations in backward (true/false)",
            env=env.FSDP_ACTIVATION_CHECKPOINTING,
        ),
        LaunchSetting(
            "fsdp_activation_checkpointing_offload",
            str,
            _bool_text("fsdp_activation_checkpointing_offload"),
            "with activation checkpointing: keep each block's checkpointed inputs in CPU memory until backward "
            "(true/false)",
            env=env.FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
        ),
        LaunchSetting(
            "fsdp_cpu_ram_efficient_loading",
            str,
            _bool_text("fsdp_cpu_ram_efficient_loading"),
            "processes other than the main one may build the model on the meta device (true/false)",
            env=env.FSDP_CPU_RAM_EFFICIENT_LOADING,
        ),
        LaunchSetting(
            "fsdp_ignored_modules",
            str,
            _ignored_modules,
            "a regular expression of module names whose parameters are not sharded (each process keeps its own)",
            env=env.FSDP_IGNORED_MODULES,
        ),
        LaunchSetting(
            "fsdp_sharding_strategy",
            str,
            _sharding_strategy,
            "FSDP1's strategy, run with FSDP2: FULL_SHARD (reshard after forward), SHARD_GRAD_OP (keep the "
            "parameters until backward), HYBRID_SHARD or HYBRID_SHARD_ZERO2 (HSDP: sharded on each machine, "
            "replicated across machines), NO_SHARD (DDP)",
            env=env.FSDP_SHARDING_STRATEGY,
        ),
        LaunchSetting(
            "fsdp_backward_prefetch",
            str,
            _backward_prefetch,
            "FSDP1's: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH; accepted, FSDP2 prefetches the next block in "
            "backward by itself",
            env=env.FSDP_BACKWARD_PREFETCH,
        ),
        *(
            LaunchSetting(f"fsdp_{name}", str, _bool_text(f"fsdp_{name}"), what, env=variable)
            for name, variable, what in (
                (
                    "forward_prefetch",
                    env.FSDP_FORWARD_PREFETCH,
                    "FSDP1's (true/false); accepted, FSDP2 overlaps the all-gathers in forward by itself",
                ),
                (
                    "use_orig_params",
                    env.FSDP_USE_ORIG_PARAMS,
                    "FSDP1's (true/false); accepted, FSDP2 always keeps the original parameters (as DTensors)",
                ),
                (
                    "sync_module_states",
                    env.FSDP_SYNC_MODULE_STATES,
                    "FSDP1's (true/false); accepted, every process starts from the main process's weights",
                ),
            )
        ),
        LaunchSetting(
            "use_parallelism_config",
            bool,
            lambda value: v.check_bool("", "use_parallelism_config", value),
            "N-D parallelism: an Accelerator() built without parallelism_config= builds a ParallelismConfig from the "
            "--parallelism_config_* sizes (their product must be num_processes)",
            env=env.HASTEN_USE_PARALLELISM_CONFIG,
        ),
        *(
            LaunchSetting(
                f"parallelism_config_{dim}_size",
                int,
                _int(f"parallelism_config_{dim}_size", ge=1),
                what,
                env=env.PARALLELISM_SIZES[f"{dim}_size"],
            )
            for dim, what in (
                ("pp", "pipeline-parallel processes (the model split into stages; the outermost dim)"),
                ("dp_replicate", "data-parallel replicas (HSDP across them; alone: DDP)"),
                ("dp_shard", "processes each replica is sharded over with FSDP2"),
                ("tp", "tensor-parallel processes (layers split; they read the same batches)"),
                ("cp", "context-parallel processes (the sequence split; CUDA only)"),
                (
                    "sp",
                    "sequence-parallel processes (Ulysses: each sequence split, attention exchanging heads for "
                    "sequence; they read the same batches)",
                ),
                ("ep", "expert-parallel processes, carved out of dp_shard (each MoE layer's experts split over them)"),
            )
        ),
        LaunchSetting(
            "parallelism_config_cp_backend",
            str,
            lambda value: v.check_choice("", "parallelism_config_cp_backend", value, ("torch",)),
            "context parallelism's implementation: torch (its context_parallel; Accelerate's deepspeed is not "
            "supported)",
            env=env.PARALLELISM_CONFIG_CP_BACKEND,
        ),
        LaunchSetting(
            "parallelism_config_sp_backend",
            str,
            lambda value: v.check_choice("", "parallelism_config_sp_backend", value, ("torch",)),
            "sequence parallelism's implementation: torch (Ulysses on FSDP2; Accelerate's deepspeed is not supported)",
            env=env.PARALLELISM_CONFIG_SP_BACKEND,
        ),
        LaunchSetting(
            "parallelism_config_cp_comm_strategy",
            str,
            lambda value: v.check_choice("", "parallelism_config_cp_comm_strategy", value, ("allgather", "alltoall")),
            "how context-parallel ranks exchange keys and values: allgather or alltoall",
            env=env.PARALLELISM_CONFIG_CP_COMM_STRATEGY,
        ),
        LaunchSetting(
            "parallelism_config_pp_schedule",
            str,
            _folded_choice("parallelism_config_pp_schedule", PIPELINE_SCHEDULES, _schedule_name),
            f"with pp_size > 1: torch's pipeline schedule, {', '.join(PIPELINE_SCHEDULES)} (any case; default 1F1B)",
            env=env.PARALLELISM_CONFIG_PP_SCHEDULE,
        ),
        LaunchSetting(
            "parallelism_config_pp_microbatches",
            int,
            _int("parallelism_config_pp_microbatches", ge=1),
            "with pp_size > 1: the microbatches each batch is cut into (default: the fewest the schedule accepts "
            "that divide the batch)",
            env=env.PARALLELISM_CONFIG_PP_MICROBATCHES,
        ),
        LaunchSetting(
            "fp8_backend",
            str,
            _folded_choice("fp8_backend", _FP8_LIBRARIES, str.upper),
            "with --mixed_precision fp8: the library of an Accelerator() built without an fp8 recipe handler, "
            "ao (torchao), te (Transformer Engine) or msamp (MS-AMP)",
            env=env.ACCELERATE_FP8_BACKEND,
        ),
        LaunchSetting(
            "fp8_pad_inner_dim",
            str,
            _bool_text("fp8_pad_inner_dim"),
            "torchao: pad the inner dimension of fp8 matmuls to a multiple of 16 (true/false; default true)",
            env=env.ACCELERATE_FP8_PAD_INNER_DIM,
        ),
        LaunchSetting(
            "fp8_enable_fsdp_float8_all_gather",
            str,
            _bool_text("fp8_enable_fsdp_float8_all_gather"),
            "torchao: FSDP2 all-gathers the weights in fp8 (true/false; default true)",
            env=env.ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER,
        ),
        LaunchSetting(
            "fp8_use_autocast_during_eval",
            bool,
            lambda value: v.check_bool("", "fp8_use_autocast_during_eval", value),
            "Transformer Engine: fp8 autocast in eval mode too",
            env=env.ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL,
        ),
        LaunchSetting(
            "fp8_margin",
            int,
            _int("fp8_margin", ge=0),
            "Transformer Engine: the scaling factor's margin (default 0)",
            env=env.ACCELERATE_FP8_MARGIN,
        ),
        LaunchSetting(
            "fp8_interval",
            int,
            _int("fp8_interval", ge=1),
            "Transformer Engine: steps between recomputations of the scaling factor (default 1)",
            env=env.ACCELERATE_FP8_INTERVAL,
        ),
        LaunchSetting(
            "fp8_format",
            str,
            _folded_choice("fp8_format", FP8_FORMATS, str.upper),
            "Transformer Engine: HYBRID (E4M3 forward, E5M2 backward), E4M3 or E5M2 (default HYBRID)",
            env=env.ACCELERATE_FP8_FORMAT,
        ),
        LaunchSetting(
            "fp8_amax_history_len",
            int,
            _int("fp8_amax_history_len", ge=1),
            "Transformer Engine: length of the amax history (default 1024)",
            env=env.ACCELERATE_FP8_AMAX_HISTORY_LEN,
        ),
        LaunchSetting(
            "fp8_amax_compute_algo",
            str,
            _folded_choice("fp8_amax_compute_algo", AMAX_COMPUTE_ALGOS, str.lower),
            "Transformer Engine: max or most_recent (default most_recent)",
            env=env.ACCELERATE_FP8_AMAX_COMPUTE_ALGO,
        ),
        LaunchSetting(
            "fp8_override_linear_precision",
            str,
            _linear_precision,
            "Transformer Engine: the fprop, dgrad and wgrad matmuls in higher precision, e.g. false,false,true",
        ),
        LaunchSetting(
            "fp8_use_mxfp8_block_scaling",
            bool,
            lambda value: v.check_bool("", "fp8_use_mxfp8_block_scaling", value),
            "Transformer Engine: MXFP8 block scaling",
            env=env.ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING,
        ),
        LaunchSetting(
            "fp8_opt_level",
            str,
            _folded_choice("fp8_opt_level", OPT_LEVELS, str.upper),
            "MS-AMP: optimisation level O1 or O2 (default O2)",
            env=env.ACCELERATE_FP8_OPT_LEVEL,
        ),
        LaunchSetting(
            "gradient_accumulation_steps",
            int,
            _int("gradient_accumulation_steps", ge=1),
            "gradient accumulation steps of an Accelerator() built without gradient_accumulation_steps=",
            env=env.HASTEN_GRADIENT_ACCUMULATION_STEPS,
            default=1,
        ),
        LaunchSetting(
            "ft_lighthouse",
            str,
            lambda value: check_lighthouse("ft_lighthouse", value),
            "fault tolerance (FaultToleranceKwargs): the address of `hasten lighthouse`, http://HOST:PORT",
            env=env.HASTEN_FT_LIGHTHOUSE,
        ),
        LaunchSetting(
            "ft_replica_group",
            int,
            _int("ft_replica_group", ge=0),
            "fault tolerance: this launch's replica group, 0 .. ft_num_replica_groups-1",
            env=env.HASTEN_FT_REPLICA_GROUP,
        ),
        LaunchSetting(
            "ft_num_replica_groups",
            int,
            _int("ft_num_replica_groups", ge=1),
            "fault tolerance: the most replica groups the job runs (the data is sharded over them)",
            env=env.HASTEN_FT_NUM_REPLICA_GROUPS,
        ),
    )
}


# Settings carried by several variables (the comma-separated parts of the value, in order).
SPLIT_SETTINGS: dict[str, tuple[str, ...]] = {"fp8_override_linear_precision": env.FP8_OVERRIDE_LINEAR_PRECISION}


def setting_variables(name: str, value: Any) -> dict[str, str]:
    """The environment variables that carry a launch setting's value to the script's Accelerator()."""
    if value is None:
        return {}
    if name in SPLIT_SETTINGS:
        return dict(zip(SPLIT_SETTINGS[name], str(value).split(",")))
    variable = LAUNCH_SETTINGS[name].env
    if not variable:
        return {}
    return {variable: ("1" if value else "0") if isinstance(value, bool) else str(value)}


def export_file_sources(settings: Mapping[str, tuple[Any, str]]) -> None:
    """Export ``HASTEN_FROM_CONFIG_FILE``: the variables exported for settings whose value came from the
    config file (an argument in code overrides those silently, as Accelerate's; a flag's or the user's
    own variable's with a warning). Unset where there are none (nor one inherited from an outer launch)."""
    names = [
        variable
        for name, (value, source) in settings.items()
        if source.startswith("config file")
        for variable in setting_variables(name, value)
    ]
    if names:
        env.export({env.HASTEN_FROM_CONFIG_FILE: ",".join(names)})
    else:
        env.unset(env.HASTEN_FROM_CONFIG_FILE)


def parse_setting_text(name: str, text: str) -> Any:
    """A launch setting written as text (a CLI flag or an answer), parsed and checked."""
    setting = LAUNCH_SETTINGS[name]
    if setting.kind is bool:
        return v.parse_bool_text(name, text, true=("y",), false=("n",))  # y/n: answers to `hasten config`
    if setting.kind in (int, float):
        try:
            value: Any = setting.kind(text)
        except ValueError:
            kind = "an integer" if setting.kind is int else "a number"
            raise ValueError(f"{name} must be {kind}, got {v.shown(text)}") from None
        return setting.check(value)
    return setting.check(text)


def _env_value(name: str, raw: str) -> Any:
    """A launch setting read from its HASTEN_* environment variable (same meaning as the Accelerator's)."""
    if LAUNCH_SETTINGS[name].kind is bool:
        return v.parse_bool_text(f"environment variable {LAUNCH_SETTINGS[name].env}", raw)
    try:
        return parse_setting_text(name, raw)
    except (TypeError, ValueError) as err:
        raise type(err)(f"environment variable {LAUNCH_SETTINGS[name].env}: {err}") from None


class SettingsError(ValueError):
    """Launch settings that do not fit together; ``key`` is the setting to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_launch_settings(settings: Mapping[str, Any]) -> None:
    """Checks that involve several settings (each one alone is checked by LAUNCH_SETTINGS)."""
    machines = settings.get("num_machines") or 1
    rank = settings.get("machine_rank") or 0
    if rank >= machines:
        raise SettingsError("machine_rank", f"machine_rank must be in 0 .. num_machines-1 = {machines - 1}, got {rank}")
    processes = settings.get("num_processes")
    if processes is not None and processes % machines:
        raise SettingsError(
            "num_processes",
            f"num_processes must be a multiple of num_machines={machines} (the same number of processes "
            f"on every machine), got {processes}",
        )
    group, groups = settings.get("ft_replica_group"), settings.get("ft_num_replica_groups")
    if group is not None and group >= (groups or 1):
        raise SettingsError(
            "ft_replica_group",
            f"ft_replica_group must be in 0 .. ft_num_replica_groups-1 = {(groups or 1) - 1}, got {group}",
        )
    most = settings.get("max_machines")
    if most is not None and most < machines:
        raise SettingsError(
            "max_machines", f"max_machines must be >= num_machines={machines} (the fewest machines), got {most}"
        )
    if most is not None and most != machines and (settings.get("rdzv_backend") or "static") != "c10d":
        raise SettingsError(
            "max_machines",
            f"an elastic number of machines ({machines}:{most}) needs rdzv_backend 'c10d', got "
            f"{settings.get('rdzv_backend') or 'static'!r}",
        )
    if machines > 1 and not settings.get("main_process_ip"):
        raise SettingsError(
            "num_machines", f"main_process_ip is needed with num_machines={machines}: the address of machine 0"
        )
