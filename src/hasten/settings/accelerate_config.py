"""Accelerate's config files, read as hasten's launch settings.

People who switch from Accelerate bring the file ``accelerate config`` wrote
(``~/.cache/huggingface/accelerate/default_config.yaml``) and the ``fsdp.yaml`` / ``multi_gpu.yaml``
/ ``fp8.yaml`` files that recipes ship for ``accelerate launch --config_file``. This module is the
one place that knows their format:

* :func:`is_accelerate_format` decides, from a file's top-level keys alone, which format the whole
  file is in: Accelerate's has ``distributed_type`` or ``compute_environment`` (every file
  Accelerate wrote, 0.11 to 1.15, has both, and Accelerate refuses one without
  ``distributed_type``); hasten's has neither. No key is ever read in both formats.
* :func:`translate` turns an Accelerate mapping into hasten's launch settings, each checked by the
  rule of the flag of the same meaning, plus the notes ``hasten launch`` prints and the keys
  ``hasten config show`` lists as doing nothing here. What hasten cannot run (DeepSpeed,
  Megatron-LM, TPUs and other accelerators, SageMaker, mpirun) is refused with what to use
  instead; unknown keys are refused all at once, each with its line and closest match.
* :func:`apply_fsdp1` maps FSDP1's settings (``fsdp_sharding_strategy``, ``fsdp_backward_prefetch``,
  ...), from a file of either format, a flag or an ``FSDP_*`` variable, to FSDP2's, once flags,
  environment and file are resolved (flag > environment > file > default, as for every setting).

Pure Python: neither torch nor yaml is imported here.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.launch_settings import (
    DYNAMO_SECTION_KEYS,
    FSDP_SHARDING_STRATEGIES,
    LAUNCH_SETTINGS,
    SettingsError,
)
from hasten.settings.plugins import FSDP1_STRATEGY_RESHARD

#: the keys that make a file Accelerate's (decided once, for the whole file)
MARKERS = ("compute_environment", "distributed_type")

# Top-level keys that are launch settings (Accelerate's name -> hasten's).
SETTING_NAMES = _SETTINGS = {
    "mixed_precision": "mixed_precision",
    "num_processes": "num_processes",
    "num_machines": "num_machines",
    "machine_rank": "machine_rank",
    "main_process_ip": "main_process_ip",
    "main_process_port": "main_process_port",
    "rdzv_backend": "rdzv_backend",
    "use_cpu": "cpu",
    "dynamo_backend": "dynamo_backend",  # Accelerate 0.15-0.16 kept it at the top level
}
_TPU_ONLY = "used by TPU launches only"
# what TPU, SageMaker and mpirun settings get instead (hasten launch refuses those flags with the same words)
_TPU = "hasten runs on CPUs and CUDA GPUs; TPUs are not supported"
_AWS = "hasten does not launch on SageMaker; run hasten launch on the machines themselves"
_MPI = "hasten starts CPU processes with torch.distributed.run, not mpirun: use --num_processes (and --num_machines)"
# Top-level keys accepted that change nothing in hasten, and why (hasten config show lists them).
_INERT = {
    "same_network": "machines reach machine 0 at main_process_ip either way",
    "downcast_bf16": "TPU only (XLA's bf16 downcast)",
    "main_training_function": (
        "the function TPU launches and notebook_launcher call; hasten runs the script as python does"
    ),
    "enable_cpu_affinity": "hasten does not pin processes to CPUs (taskset or numactl around hasten launch do)",
    **{key: _TPU_ONLY for key in ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env")},
    "command_file": _TPU_ONLY,
    "commands": _TPU_ONLY,
}
_OWN = ("compute_environment", "distributed_type", "gpu_ids", "debug", "fp16")  # translated here, one by one

# Accelerate's fp8_config keys that `accelerate config` writes under other names than its --fp8_* flags
# (its launcher exports them under variables no recipe reads; hasten maps them).
FP8_KEY_ALIASES: dict[str, str] = {
    "fp8_amax_history_length": "fp8_amax_history_len",
    "fp8_amax_compute_algorithm": "fp8_amax_compute_algo",
    "fp8_optimization_level": "fp8_opt_level",
}
# Section -> (the prefix its keys are the launch settings of, other accepted names -> setting, or None).
_SP_KEYS = ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")  # DeepSpeed's sp only
_PREFIXED: dict[str, tuple[str, dict[str, str | None]]] = {
    "fsdp_config": ("fsdp_", {"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"}),  # 0.15-0.27's name
    "parallelism_config": (
        "parallelism_config_",
        {
            "parallelism_config_sp_size": "parallelism_config_sp_size",
            "parallelism_config_sp_backend": None,
            **{f"parallelism_config_{k}": None for k in _SP_KEYS},
        },
    ),
    "fp8_config": ("fp8_", dict(FP8_KEY_ALIASES)),
    "dynamo_config": ("dynamo_", {}),
}
# Sections whose keys are Accelerate's only: anything (refused or ignored as a whole), or these keys.
_WHOLE: dict[str, tuple[str, ...] | None] = {
    "deepspeed_config": None,
    "megatron_lm_config": None,
    "mpirun_config": None,
    "ipex_config": ("ipex", "use_xpu"),
    "tp_config": ("tp_size",),
}
TOP_LEVEL_KEYS: tuple[str, ...] = (*_OWN, *_SETTINGS, *_INERT, *_PREFIXED, *_WHOLE)

COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
_OTHER_DEVICES = ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
#: every distributed_type of Accelerate 0.11-1.15 (TPU was renamed XLA, TP lived in 1.6-1.7)
DISTRIBUTED_TYPES = (
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "FSDP",
    "TP",
    "DEEPSPEED",
    "MEGATRON_LM",
    "XLA",
    "TPU",
    *_OTHER_DEVICES,
)
ACCELERATE_DEFAULT_CONFIG = Path("accelerate") / "default_config.yaml"


def accelerate_default_config_path() -> Path:
    """Accelerate's default config file: ``$HF_HOME/accelerate/default_config.yaml``, else
    ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/huggingface/accelerate/default_config.yaml``."""
    home = env.get(env.HF_HOME)
    if not home:
        cache = env.get(env.XDG_CACHE_HOME) or os.path.join("~", ".cache")
        home = os.path.join(cache, "huggingface")
    return Path(home).expanduser() / ACCELERATE_DEFAULT_CONFIG


def is_accelerate_format(data: Mapping[Any, Any]) -> bool:
    """Whether a config file's top-level mapping is Accelerate's format (it names a marker key)."""
    return any(key in data for key in MARKERS)


@dataclass
class AccelerateFile:
    """An Accelerate config file translated: launch settings (checked) and what to tell the user."""

    launch: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, tuple[str, ...]] = field(default_factory=dict)  # setting -> key path in the file
    notes: list[str] = field(default_factory=list)  # printed by hasten launch and hasten config show
    inert: list[str] = field(default_factory=list)  # keys that do nothing here (hasten config show)
    gpu_ids: str | None = None
    debug: bool = False
    distributed_type: str = "NO"


class _Reader:
    """One file's translation: where each key is, and the settings gathered so far."""

    def __init__(self, path: Path, lines: Mapping[tuple[str, ...], int]) -> None:
        self.path, self.lines, self.out = path, lines, AccelerateFile()

    def where(self, *keys: str) -> str:
        line = self.lines.get(tuple(keys))
        return f"{self.path}, line {line}" if line else str(self.path)

    def put(self, keys: tuple[str, ...], name: str, value: Any) -> None:
        """Setting ``name`` from the file's key ``keys``, checked as the flag of that name."""
        if value is None:
            return
        try:
            self.out.launch[name] = LAUNCH_SETTINGS[name].check(value)
        except (TypeError, ValueError) as err:
            shown = "" if keys[-1] == name else f"[{'.'.join(keys)}] "
            raise type(err)(f"{self.where(*keys)}: {shown}{err}") from None
        self.out.origin[name] = keys

    def refuse(self, keys: tuple[str, ...], why: str) -> ValueError:
        return ValueError(f"{self.where(*keys)}: {why}")


# ----------------------------------------------------------------------------- unknown keys


def _section_setting(section: str, key: str) -> str | None:
    """The launch setting a key of a prefixed section names ("" for an accepted key without one),
    or None when the key is unknown there."""
    prefix, others = _PREFIXED[section]
    name = key if key.startswith(prefix) else prefix + key
    if name in others:
        return others[name] or ""
    return name if name in LAUNCH_SETTINGS else None


def _allowed(section: str) -> list[str]:
    if section in _WHOLE:
        return list(_WHOLE[section] or ())
    prefix, others = _PREFIXED[section]
    if section == "dynamo_config":
        return [f"dynamo_{k}" for k in DYNAMO_SECTION_KEYS]
    return [n for n in LAUNCH_SETTINGS if n.startswith(prefix)] + [n for n in others if others[n] is None]


def _unknown_keys(r: _Reader, data: Mapping[Any, Any]) -> None:
    """Refuse every key Accelerate's format does not have, at once (as Accelerate does), each with
    its line and its closest match."""
    found: list[str] = []
    places: dict[str, list[str]] = {}
    for key, value in data.items():
        if key not in TOP_LEVEL_KEYS:
            places.setdefault("the top level", list(TOP_LEVEL_KEYS))
            found.append(_unknown_entry(r, (str(key),), key, TOP_LEVEL_KEYS))
            continue
        if not isinstance(value, dict) or (key in _WHOLE and _WHOLE[key] is None):
            continue
        for sub in value:
            known = sub in (_WHOLE[key] or ()) if key in _WHOLE else _section_setting(key, str(sub)) is not None
            if not known:
                places.setdefault(key, _allowed(key))
                found.append(_unknown_entry(r, (str(key), str(sub)), sub, places[key], key))
    if found:
        allowed = "; ".join(f"{place}: {', '.join(keys)}" for place, keys in places.items())
        raise ValueError(
            f"{r.path}: unknown key{'s' if len(found) > 1 else ''} in an Accelerate config file: "
            f"{', '.join(found)}. Allowed keys at {allowed}"
        )


def _unknown_entry(r: _Reader, keys: tuple[str, ...], key: Any, allowed: Any, section: str | None = None) -> str:
    line = r.lines.get(keys)
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    hint = [f"line {line}"] if line else []
    hint += [f"in {section}"] if section else []
    if close:
        hint.append(f"did you mean {close[0]!r}?")
    elif section is None and str(key) in LAUNCH_SETTINGS:
        hint.append(f"hasten's own key: give --{key}, or use a file in hasten's format (without distributed_type)")
    return f"{v.shown(key)} ({'; '.join(hint)})" if hint else v.shown(key)


# ----------------------------------------------------------------------------- what hasten cannot run


def _deepspeed_advice(section: Any) -> str:
    """What to use instead of DeepSpeed: the FSDP2 settings that match the file's ZeRO stage."""
    section = section if isinstance(section, dict) else {}
    stage = section.get("zero_stage")
    offload = any(section.get(k) in ("cpu", "nvme") for k in ("offload_param_device", "offload_optimizer_device"))
    by_stage = {
        0: "ZeRO stage 0 is plain data parallelism: distributed_type: MULTI_GPU (DDP)",
        1: "ZeRO stage 1 (optimizer states sharded) is closest to FSDP2 keeping the parameters until backward: "
        "distributed_type: FSDP with fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: false}",
        2: "ZeRO stage 2 is FSDP2 keeping the gathered parameters until backward: distributed_type: FSDP with "
        "fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: false}",
        3: "ZeRO stage 3 is FSDP2 resharding after forward: distributed_type: FSDP with fsdp_config: "
        "{fsdp_version: 2, fsdp_reshard_after_forward: true}",
    }
    if stage in by_stage:
        advice = by_stage[stage]
    else:
        where = (
            " (zero_optimization.stage of its deepspeed_config_file)" if section.get("deepspeed_config_file") else ""
        )
        advice = f"use FSDP2 as your ZeRO stage{where} says: " + "; ".join(by_stage[s] for s in (0, 2, 3))
    if offload:
        advice += "; offloading to the CPU is fsdp_offload_params: true"
    extra = []
    if section.get("gradient_accumulation_steps") not in (None, 1):
        extra.append(f"--gradient_accumulation_steps {section['gradient_accumulation_steps']}")
    if section.get("gradient_clipping") is not None:
        extra.append("accelerator.clip_grad_norm_() in the script")
    tail = f" ({', '.join(extra)} for the rest)" if extra else ""
    return f"distributed_type DEEPSPEED: hasten does not run DeepSpeed. {advice}{tail}"


def _check_zero_stage(r: _Reader, section: Any) -> None:
    """``deepspeed_config.zero_stage``: absent, or one of DeepSpeed's stages 0-3 (an integer)."""
    stage = section.get("zero_stage") if isinstance(section, dict) else None
    if stage is None or (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
        return
    raise r.refuse(
        ("deepspeed_config", "zero_stage"),
        "deepspeed_config: zero_stage must be one of DeepSpeed's stages 0, 1, 2 or 3 (an integer), "
        f"got {v.shown(stage)}",
    )


def _megatron_advice(section: Any) -> str:
    section = section if isinstance(section, dict) else {}
    parts = [
        f"parallelism_config_{size}: {section.get(f'megatron_lm_{degree}', 'N')}"
        for degree, size in (("tp_degree", "tp_size"), ("pp_degree", "pp_size"))
    ]
    if section.get("megatron_lm_num_micro_batches") is not None:
        parts.append(f"parallelism_config_pp_microbatches: {section['megatron_lm_num_micro_batches']}")
    return (
        "distributed_type MEGATRON_LM: hasten does not run Megatron-LM; its tensor and pipeline parallelism are "
        "hasten's N-D parallelism: distributed_type: MULTI_GPU (or FSDP) with parallelism_config: "
        f"{{{', '.join(parts)}}}"
    )


def _distributed_type(r: _Reader, data: Mapping[Any, Any]) -> str:
    """The file's distributed_type, checked; what hasten cannot run is refused with what to use instead."""
    if "distributed_type" not in data:
        raise r.refuse(
            ("compute_environment",),
            "an Accelerate config file needs distributed_type (NO, MULTI_CPU, MULTI_GPU or FSDP), as Accelerate says",
        )
    raw = data["distributed_type"]
    kind = "NO" if raw is False else str(raw).strip().upper()  # YAML 1.1 reads a bare NO as false
    keys = ("distributed_type",)
    if kind not in DISTRIBUTED_TYPES:
        raise r.refuse(keys, f"distributed_type must be one of {', '.join(DISTRIBUTED_TYPES)}, got {v.shown(raw)}")
    if kind == "DEEPSPEED":
        _check_zero_stage(r, data.get("deepspeed_config"))
        raise r.refuse(keys, _deepspeed_advice(data.get("deepspeed_config")))
    if kind == "MEGATRON_LM":
        raise r.refuse(keys, _megatron_advice(data.get("megatron_lm_config")))
    if kind in ("XLA", "TPU"):
        raise r.refuse(keys, f"distributed_type {kind}: {_TPU}; use distributed_type MULTI_GPU or MULTI_CPU")
    if kind in _OTHER_DEVICES:
        raise r.refuse(
            keys,
            f"distributed_type {kind}: hasten runs on CPUs and CUDA GPUs only; use distributed_type MULTI_GPU "
            "(CUDA) or MULTI_CPU",
        )
    environment = data.get("compute_environment") or "LOCAL_MACHINE"
    if str(environment).upper() == "AMAZON_SAGEMAKER":
        raise r.refuse(("compute_environment",), f"compute_environment AMAZON_SAGEMAKER: {_AWS}")
    if str(environment).upper() != "LOCAL_MACHINE":
        raise r.refuse(
            ("compute_environment",),
            "compute_environment must be LOCAL_MACHINE (or AMAZON_SAGEMAKER, not supported), got "
            f"{v.shown(environment)}",
        )
    return kind


# ----------------------------------------------------------------------------- translation


def translate(data: Mapping[Any, Any], path: Path, lines: Mapping[tuple[str, ...], int]) -> AccelerateFile:
    """An Accelerate config file's top-level mapping as hasten's launch settings; ``lines`` maps
    each key path to its 1-based line (for the errors)."""
    r = _Reader(path, lines)
    _unknown_keys(r, data)
    r.out.distributed_type = kind = _distributed_type(r, data)
    for key, value in data.items():
        key = str(key)
        if key in _SETTINGS:
            _top_setting(r, key, value)
        elif key in _INERT:
            _inert(r, key, value)
        elif key in _PREFIXED:
            _prefixed(r, key, value)
        elif key in _WHOLE:
            _whole(r, key, value, kind)
    _extras(r, data)
    if kind == "MULTI_CPU":
        r.out.launch["cpu"], r.out.origin["cpu"] = True, ("distributed_type",)
    elif kind == "FSDP":
        r.out.launch["use_fsdp"], r.out.origin["use_fsdp"] = True, ("distributed_type",)
    elif kind == "TP":
        r.out.launch["use_parallelism_config"], r.out.origin["use_parallelism_config"] = True, ("distributed_type",)
    return r.out


def _top_setting(r: _Reader, key: str, value: Any) -> None:
    if key == "num_processes" and value == -1:  # Accelerate: "pass --num_processes with this file"
        r.out.notes.append(
            f"{r.where(key)}: num_processes -1 (Accelerate's 'give --num_processes') leaves the count to "
            "--num_processes, else one process per GPU (1 without GPUs)"
        )
        return
    r.put((key,), _SETTINGS[key], value)


def _inert(r: _Reader, key: str, value: Any) -> None:
    if key == "enable_cpu_affinity" and value is True:
        r.out.notes.append(f"{r.where(key)}: enable_cpu_affinity: {_INERT[key]}")
    elif value not in (None, False, [], "", "no", "NO"):
        r.out.inert.append(f"{key}: {v.shown(value)}: {_INERT[key]}")
    else:
        r.out.inert.append(f"{key}: {_INERT[key]}")


def _prefixed(r: _Reader, section: str, value: Any) -> None:
    """fsdp_config, parallelism_config, fp8_config, dynamo_config: their keys are launch settings
    (prefixed as Accelerate's launcher prefixes them), checked by the flags' rules."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise r.refuse((section,), f"section {section!r} must be a mapping, got {v.shown(value)}")
    for key, item in value.items():
        keys = (section, str(key))
        name = _section_setting(section, str(key))
        if name == "":  # parallelism_config's sequence-parallel keys (Accelerate runs sp on DeepSpeed)
            _sequence_parallel(r, keys, item, value)
        elif name == "fsdp_version" and item == 1:
            r.out.notes.append(
                f"{r.where(*keys)}: fsdp_version 1: hasten runs FSDP2 (fully_shard), with the FSDP1 settings mapped "
                "(hasten config show lists how)"
            )
        elif name == "fsdp_state_dict_type" and str(item).upper().endswith("LOCAL_STATE_DICT"):
            raise r.refuse(
                keys,
                "fsdp_state_dict_type LOCAL_STATE_DICT is FSDP1's; FSDP2 has SHARDED_STATE_DICT (each process "
                "its shards, reloadable at another size) and FULL_STATE_DICT",
            )
        elif name is not None:
            r.put(keys, name, item)
    if section == "parallelism_config" and value:
        r.out.launch["use_parallelism_config"] = True
        r.out.origin["use_parallelism_config"] = (section,)


def _sequence_parallel(r: _Reader, keys: tuple[str, ...], item: Any, section: dict) -> None:
    """parallelism_config's sequence-parallel keys other than the size: the backend (torch's Ulysses
    runs; DeepSpeed's is refused where the size asks for it) and DeepSpeed's own settings (inert)."""
    size = section.get("parallelism_config_sp_size", section.get("sp_size"))
    if keys[-1].endswith("sp_backend"):
        backend = str(item).strip().lower() if item is not None else None
        if backend in (None, "torch"):
            if backend:
                r.put(keys, "parallelism_config_sp_backend", "torch")
            return
        if size not in (None, 1):
            raise r.refuse(
                keys,
                f"{keys[-1]} {v.shown(item)} with sp_size {v.shown(size)} asks for DeepSpeed's sequence parallelism "
                "(ALST/Ulysses); hasten does not run DeepSpeed: set parallelism_config_sp_backend: torch (Ulysses on "
                "FSDP2, the same all-to-all of heads), or sp_size 1",
            )
    r.out.inert.append(f"{'.'.join(keys)}: DeepSpeed's sequence-parallel setting; hasten's Ulysses does not read it")


def _whole(r: _Reader, section: str, value: Any, kind: str) -> None:
    """Sections of what hasten does not run: empty is fine; what would change the run is refused."""
    if not value:  # `deepspeed_config: {}` and the like: old files carry them
        return
    if not isinstance(value, dict):
        raise r.refuse((section,), f"section {section!r} must be a mapping, got {v.shown(value)}")
    if section == "mpirun_config" and value.get("mpirun_hostfile"):
        raise r.refuse((section, "mpirun_hostfile"), f"mpirun_config.mpirun_hostfile: {_MPI}")
    if section == "ipex_config":
        if value.get("use_xpu"):
            raise r.refuse((section, "use_xpu"), "ipex_config.use_xpu: hasten runs on CPUs and CUDA GPUs only")
        if value.get("ipex"):
            r.out.notes.append(
                f"{r.where(section, 'ipex')}: ipex_config.ipex: hasten has no IPEX mode; CPU training runs as it is"
            )
        return
    if section == "tp_config" and kind == "TP":
        r.put((section, "tp_size"), "parallelism_config_tp_size", value.get("tp_size"))
        return
    owner = {"deepspeed_config": "DEEPSPEED", "megatron_lm_config": "MEGATRON_LM", "tp_config": "TP"}.get(section)
    r.out.inert.append(f"{section}: ignored, as Accelerate ignores it: distributed_type is {kind}, not {owner}")


def _extras(r: _Reader, data: Mapping[Any, Any]) -> None:
    """gpu_ids, debug and the oldest files' fp16."""
    gpu_ids = data.get("gpu_ids")
    if gpu_ids is not None:
        text = str(gpu_ids).strip()
        if text.lower() != "all" and not all(p.strip().isdigit() for p in text.split(",")):
            raise r.refuse(("gpu_ids",), f"gpu_ids must be 'all' or GPU numbers such as 0,1, got {v.shown(gpu_ids)}")
        r.out.gpu_ids = None if text.lower() == "all" else text.replace(" ", "")
    debug = data.get("debug")
    if debug is not None:
        r.out.debug = (
            v.check_bool("", "debug", debug) if not isinstance(debug, str) else v.parse_bool_text("debug", debug)
        )
    if data.get("fp16") and "mixed_precision" not in r.out.launch:  # before 0.11: fp16: true
        r.put(("fp16",), "mixed_precision", "fp16")


# ----------------------------------------------------------------------------- FSDP1 -> FSDP2


def _rank(source: str) -> int:
    """Precedence of a setting's source: flag, environment, config file, default."""
    if source == "flag":
        return 0
    if source.startswith("environment"):
        return 1
    return 2 if source.startswith("config file") else 3


def _derive(resolved: dict[str, tuple[Any, str]], name: str, value: Any, source: str, why: str) -> None:
    """Set ``name`` to ``value`` (what ``why`` means) unless a stronger source set it; the same source
    saying otherwise is an error."""
    current, where = resolved[name]
    if current is None or _rank(where) > _rank(source):
        resolved[name] = (value, f"{source}: {why}")
    elif current != value and _rank(where) == _rank(source):
        raise SettingsError(
            name, f"{why} means {name} {value}, but {name} is {current} (both from the {source}): give one of them"
        )


_FSDP2_DOES = {
    "fsdp_backward_prefetch": "FSDP2 prefetches the next block's all-gather in backward by itself",
    "fsdp_forward_prefetch": "FSDP2 overlaps the all-gathers in forward by itself",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "fsdp_sync_module_states": "hasten starts every process from the main process's weights",
}


def _strategy(resolved: dict[str, tuple[Any, str]]) -> tuple[str | None, str]:
    """The sharding strategy: fsdp_sharding_strategy, or FSDP1's strategy written as
    fsdp_reshard_after_forward (Accelerate 1.6+), the stronger source winning."""
    strategy, source = resolved["fsdp_sharding_strategy"]
    reshard, r_source = resolved["fsdp_reshard_after_forward"]
    if reshard in FSDP_SHARDING_STRATEGIES:
        resolved["fsdp_reshard_after_forward"] = (None, "default")
        if strategy is None or _rank(r_source) < _rank(source):
            strategy, source = reshard, r_source
        elif strategy != reshard and _rank(r_source) == _rank(source):
            raise SettingsError(
                "fsdp_sharding_strategy",
                f"fsdp_sharding_strategy {strategy} and fsdp_reshard_after_forward {reshard} (both from the {source}) "
                "disagree: give one of them",
            )
        resolved["fsdp_sharding_strategy"] = (strategy, source)
    return strategy, source


def _hybrid(resolved: dict[str, tuple[Any, str]], source: str, why: str, num_processes: int | None) -> str:
    """HYBRID_SHARD: FSDP1 shards within each machine and replicates across machines: HSDP."""
    dims = ("parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size")
    if any(resolved[d][1] != "default" for d in dims):
        return ", HSDP over the parallelism_config_dp_replicate_size x dp_shard_size given"
    machines = resolved["num_machines"][0] or 1
    if machines == 1:
        return ", sharded over every process of this one machine (hybrid sharding needs several machines)"
    per_machine = None if num_processes is None else num_processes // machines
    _derive(resolved, dims[0], machines, source, why)
    _derive(resolved, dims[1], per_machine, source, why + " (the processes of each machine, set at launch)")
    _derive(resolved, "use_parallelism_config", True, source, why)
    shard = per_machine if per_machine is not None else "the processes of each machine"
    return f", HSDP: parallelism_config_dp_replicate_size {machines} (the machines) x dp_shard_size {shard}"


def apply_fsdp1(resolved: dict[str, tuple[Any, str]], num_processes: int | None) -> list[str]:
    """Map the FSDP1 settings in ``resolved`` (setting -> (value, source), as ``resolve_settings``
    returns it) to FSDP2's, in place; returns the note that says how (none without FSDP1 settings).
    ``num_processes`` (None: not known yet) sizes HYBRID_SHARD's mesh on several machines."""
    strategy, source = _strategy(resolved)
    mapped = []
    if strategy == "NO_SHARD":
        use, use_source = resolved["use_fsdp"]
        if use and _rank(use_source) < _rank(source):
            raise SettingsError(
                "use_fsdp",
                f"use_fsdp ({use_source}) asks for FSDP, but fsdp_sharding_strategy NO_SHARD ({source}) asks not to "
                "shard: drop one of them",
            )
        resolved["use_fsdp"] = (False, f"{source}: fsdp_sharding_strategy NO_SHARD")
        mapped.append("fsdp_sharding_strategy NO_SHARD = DDP (every process keeps the whole model)")
    elif strategy is not None:
        why = f"fsdp_sharding_strategy {strategy}"
        value = "true" if FSDP1_STRATEGY_RESHARD[strategy] else "false"  # the plugin's mapping in code too
        _derive(resolved, "fsdp_reshard_after_forward", value, source, why)
        text = f"{why} = fsdp_reshard_after_forward {resolved['fsdp_reshard_after_forward'][0]}"
        mapped.append(text + (_hybrid(resolved, source, why, num_processes) if strategy.startswith("HYBRID") else ""))
    for name, does in _FSDP2_DOES.items():
        if resolved[name][0] is not None and (resolved["use_fsdp"][0] or strategy is not None):
            mapped.append(f"{name} {resolved[name][0]}: {does}")
    return ["FSDP1 settings run with FSDP2: " + "; ".join(mapped)] if mapped else []
