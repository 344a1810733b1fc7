"""hasten's YAML config file: launch settings plus default kwargs handlers.

A config file holds two kinds of top-level keys:

* launch settings (``num_processes``, ``mixed_precision``, ...), read by ``hasten launch``
  and overridden by its flags and by the ``HASTEN_*`` environment variables;
* handler sections, one per kwargs handler, whose keys are that handler's fields::

      ddp: {bucket_cap_mb: 50, comm_hook: fp16}   # DistributedDataParallelKwargs
      autocast: {cache_enabled: false}            # AutocastKwargs
      grad_scaler: {init_scale: 1024}             # GradScalerKwargs
      profile: {activities: [cpu]}                # ProfileKwargs
      process_group: {timeout: 900}               # InitProcessGroupKwargs, timeout in seconds

``hasten launch`` exports the file's path as ``HASTEN_CONFIG_FILE``; an ``Accelerator``
built in the script then calls :func:`handlers_from_env` and uses those handlers as defaults
that handlers passed in code override.

Values are checked by the same rules as the CLI flags (launch settings) and by the handlers'
own constructors (handler sections); errors name the file, the line, the key and what is
allowed. A file is bounded before anything is built from it: 1 MiB, ``MAX_CONFIG_VALUES``
values (each use of a YAML alias counted again) and ``MAX_CONFIG_DEPTH`` levels. Pure Python
apart from PyYAML, which is imported when a file is read or written
(``pip install hasten[config]``); torch is never imported here.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _validate as v
from . import environment as env
from .choices import DYNAMO_MODES, MIXED_PRECISION_CHOICES, RDZV_BACKENDS

DEFAULT_CONFIG_NAME = "default_config.yaml"
# A config file holds a few dozen lines; YAML takes minutes on a file of 100 MB.
MAX_CONFIG_BYTES = 1 << 20
# Values in a whole file (each use of a YAML alias counted again) and levels of nesting: a real
# file has a few dozen values and three levels (file, section, a field's mapping).
MAX_CONFIG_VALUES = 5000
MAX_CONFIG_DEPTH = 20

# Section name -> handler class name in hasten.handlers (imported when a file is built).
HANDLER_SECTIONS: dict[str, str] = {
    "ddp": "DistributedDataParallelKwargs",
    "autocast": "AutocastKwargs",
    "grad_scaler": "GradScalerKwargs",
    "profile": "ProfileKwargs",
    "process_group": "InitProcessGroupKwargs",
}

# ----------------------------------------------------------------------------- launch settings


def _mixed_precision(value: Any) -> str:
    if value is False:  # YAML 1.1 reads a bare `no` as false
        value = "no"
    return v.check_choice("", "mixed_precision", value.lower() if isinstance(value, str) else value, MIXED_PRECISION_CHOICES)


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


from .options import FSDP_STATE_DICT_TYPES as FSDP_STATE_DICT_CHOICES  # noqa: E402
from .options import FSDP_WRAP_POLICIES as FSDP_WRAP_POLICY_CHOICES  # noqa: E402


def _bool_text(name: str) -> Callable[[Any], str]:
    """A true/false setting that Accelerate's launcher takes as a value (``--fsdp_offload_params true``)."""

    def check(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if not isinstance(value, str):
            raise TypeError(f"{name} must be true or false, got {v.shown(value)}")
        return "true" if v.parse_bool_text(name, value) else "false"

    return check


def _reshard(value: Any) -> str:
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
            "fsdp_version", int, _int("fsdp_version", ge=1, le=2), "FSDP version: 2 (hasten implements FSDP2)",
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
            "fsdp_min_num_params", int, _int("fsdp_min_num_params", ge=0),
            "parameters a submodule needs to be sharded on its own, with size_based_wrap", env=env.FSDP_MIN_NUM_PARAMS,
        ),
        LaunchSetting(
            "fsdp_reshard_after_forward", str, _reshard,
            "free the gathered parameters after forward: true, false or a group size >= 2",
            env=env.FSDP_RESHARD_AFTER_FORWARD,
        ),
        LaunchSetting(
            "fsdp_offload_params", str, _bool_text("fsdp_offload_params"),
            "keep parameters, gradients and optimizer state on the CPU (true/false)", env=env.FSDP_OFFLOAD_PARAMS,
        ),
        LaunchSetting(
            "fsdp_state_dict_type",
            str,
            lambda value: v.check_choice("", "fsdp_state_dict_type", str(value).upper(), FSDP_STATE_DICT_CHOICES),
            "checkpoints: SHARDED_STATE_DICT (each process its shards, reloadable at another size) or FULL_STATE_DICT",
            env=env.FSDP_STATE_DICT_TYPE,
        ),
        LaunchSetting(
            "fsdp_activation_checkpointing", str, _bool_text("fsdp_activation_checkpointing"),
            "recompute each sharded block's activations in backward (true/false)",
            env=env.FSDP_ACTIVATION_CHECKPOINTING,
        ),
        LaunchSetting(
            "fsdp_activation_checkpointing_offload", str, _bool_text("fsdp_activation_checkpointing_offload"),
            "with activation checkpointing: keep each block's checkpointed inputs in CPU memory until backward "
            "(true/false)",
            env=env.FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD,
        ),
        LaunchSetting(
            "fsdp_cpu_ram_efficient_loading", str, _bool_text("fsdp_cpu_ram_efficient_loading"),
            "processes other than the main one may build the model on the meta device (true/false)",
            env=env.FSDP_CPU_RAM_EFFICIENT_LOADING,
        ),
        LaunchSetting(
            "use_parallelism_config", bool, lambda value: v.check_bool("", "use_parallelism_config", value),
            "N-D parallelism: an Accelerator() built without parallelism_config= builds a ParallelismConfig from the "
            "--parallelism_config_* sizes (their product must be num_processes)",
            env=env.HASTEN_USE_PARALLELISM_CONFIG,
        ),
        *(
            LaunchSetting(
                f"parallelism_config_{dim}_size", int, _int(f"parallelism_config_{dim}_size", ge=1), what,
                env=env.PARALLELISM_SIZES[f"{dim}_size"],
            )
            for dim, what in (
                ("dp_replicate", "data-parallel replicas (HSDP across them; alone: DDP)"),
                ("dp_shard", "processes each replica is sharded over with FSDP2"),
                ("tp", "tensor-parallel processes (layers split; they read the same batches)"),
                ("cp", "context-parallel processes (the sequence split; CUDA only)"),
            )
        ),
        LaunchSetting(
            "parallelism_config_cp_backend", str,
            lambda value: v.check_choice("", "parallelism_config_cp_backend", value, ("torch",)),
            "context parallelism's implementation: torch (its context_parallel; Accelerate's deepspeed is not supported)",
            env=env.PARALLELISM_CONFIG_CP_BACKEND,
        ),
        LaunchSetting(
            "parallelism_config_cp_comm_strategy", str,
            lambda value: v.check_choice("", "parallelism_config_cp_comm_strategy", value, ("allgather", "alltoall")),
            "how context-parallel ranks exchange keys and values: allgather or alltoall",
            env=env.PARALLELISM_CONFIG_CP_COMM_STRATEGY,
        ),
        LaunchSetting(
            "gradient_accumulation_steps",
            int,
            _int("gradient_accumulation_steps", ge=1),
            "gradient accumulation steps of an Accelerator() built without gradient_accumulation_steps=",
            env=env.HASTEN_GRADIENT_ACCUMULATION_STEPS,
            default=1,
        ),
    )
}


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


# ----------------------------------------------------------------------------- file locations


def default_config_path() -> Path:
    """``$HASTEN_CONFIG_HOME/default_config.yaml``, else ``$XDG_CACHE_HOME`` or ``~/.cache``
    ``/hasten/default_config.yaml``."""
    home = env.get(env.HASTEN_CONFIG_HOME)
    if home:
        return Path(home).expanduser() / DEFAULT_CONFIG_NAME
    cache = env.get(env.XDG_CACHE_HOME) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hasten" / DEFAULT_CONFIG_NAME


def find_config_file(explicit: str | os.PathLike | None = None) -> Path | None:
    """The config file in use: ``explicit``, else ``$HASTEN_CONFIG_FILE``, else the default
    path when that file exists. A file named explicitly or by the variable must exist."""
    for source, value in (("--config_file", explicit), (env.HASTEN_CONFIG_FILE, env.get(env.HASTEN_CONFIG_FILE))):
        if value:
            path = Path(value).expanduser().resolve()
            check_config_path(path, source)
            return path
    path = default_config_path()
    return path.resolve() if path.is_file() else None


def check_config_path(path: Path, source: str | None = None) -> int:
    """Refuse what cannot be a config file: missing, a folder, not a regular file (a device, a
    pipe) or larger than ``MAX_CONFIG_BYTES``. Returns the file's size. ``source`` (a flag or
    an environment variable) is named in the message."""
    where = f"config file {str(path)!r}" + (f" (from {source})" if source else "")
    try:
        info = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{where} does not exist") from None
    except OSError as err:
        raise ValueError(f"{where} cannot be read: {err.strerror or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{where} is a folder, not a file: name the YAML file itself, e.g. {str(path / DEFAULT_CONFIG_NAME)!r}")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{where} is not a regular file (a device, a pipe or a socket): name a YAML file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{where} is {info.st_size} bytes; a config file may be at most {MAX_CONFIG_BYTES} bytes (1 MiB): "
            "is it the right file?"
        )
    return info.st_size


def _read_config_text(path: Path, source: str | None) -> str:
    check_config_path(path, source)
    where = f"config file {str(path)!r}" + (f" (from {source})" if source else "")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # bounded even if the file grows while it is read
    except OSError as err:
        raise ValueError(f"{where} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes (1 MiB), the most a config file may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 text (byte {err.start}): is it a YAML file?") from None


# ----------------------------------------------------------------------------- reading


@dataclass
class ConfigFile:
    """A parsed config file: its launch settings (checked) and its handler sections (raw)."""

    path: Path
    launch: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)  # key path -> 1-based line
    text: str = ""

    def where(self, *keys: str) -> str:
        line = self.lines.get(tuple(keys))
        return f"{self.path}, line {line}" if line else str(self.path)


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is in the test extras
        raise ImportError("hasten's config files need PyYAML: pip install 'hasten[config]'") from None
    return yaml


def _allowed_top_keys() -> str:
    return (
        f"launch settings {', '.join(LAUNCH_SETTINGS)}; "
        f"handler sections {', '.join(f'{k} ({c})' for k, c in HANDLER_SECTIONS.items())}"
    )


def _unknown(where: str, key: Any, allowed: list[str], allowed_text: str) -> ValueError:
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"{where}: unknown key {v.shown(key)}{hint} Allowed keys: {allowed_text}")


def _mapping_lines(cfg: ConfigFile, node: Any, prefix: tuple[str, ...]) -> None:
    """Record the line of every key under a mapping node; refuse duplicated keys."""
    yaml = _yaml()
    seen: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = key_node.value
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ValueError(
                f"{cfg.path}, line {line}: key {v.shown(key)} appears twice (lines {seen[key]} and {line})"
            )
        seen[key] = line
        cfg.lines[(*prefix, str(key))] = line
        if isinstance(value_node, yaml.MappingNode) and len(prefix) < 2:
            _mapping_lines(cfg, value_node, (*prefix, str(key)))


class _SizeCheck:
    """Counts a YAML text's values and levels from its parser's events, before anything is built.

    Each use of an alias counts as many values as the anchored value holds: ~300 bytes of
    aliases (``b: &b [*a, *a, ...]``, "billion laughs") stand for a billion values, which a check,
    an error message's repr or a merge key (``<<: [*a, *a]``) would expand. PyYAML's parser keeps its
    own stack, so a deep file costs no recursion here (its composer would recurse)."""

    def __init__(self, cfg: ConfigFile) -> None:
        self.cfg = cfg
        self.yaml = _yaml()
        self.anchors: dict[str, tuple[int, int]] = {}  # anchor -> (values, levels) of what it names
        self.open: list[list[Any]] = []  # each open mapping or sequence: [values, levels below, anchor]
        self.total = 0
        self.top_mapping = False
        self.children = 0  # nodes completed under the top-level mapping (odd: reading a key's value)
        self.key: tuple[str, int] | None = None  # the top-level key being read, and its line

    def refuse(self, event: Any, why: str) -> ValueError:
        if self.top_mapping and self.children % 2 and self.key is not None:
            name, line = self.key
        else:
            name, line = "a key" if self.top_mapping else "the file", event.start_mark.line + 1
        return ValueError(f"config file {self.cfg.path}, line {line}: {name} {why}")

    def too_big(self, event: Any) -> ValueError:
        return self.refuse(
            event,
            f"is too large or too deeply nested (more than {MAX_CONFIG_VALUES} values or {MAX_CONFIG_DEPTH} "
            "levels, each use of a YAML alias counted again): a setting is a number, a word or a short list, "
            "a section a short mapping of them",
        )

    def node(self, event: Any) -> None:
        """One event of the stream; a ValueError once the bounds are passed."""
        yaml = self.yaml
        if isinstance(event, yaml.CollectionStartEvent):
            if not self.open:
                self.top_mapping = isinstance(event, yaml.MappingStartEvent)
            self.open.append([1, 0, event.anchor])
            self.total += 1
            if len(self.open) > MAX_CONFIG_DEPTH or self.total > MAX_CONFIG_VALUES:
                raise self.too_big(event)
            return
        if isinstance(event, yaml.CollectionEndEvent):
            values, levels, anchor = self.open.pop()
            size = (values, levels + 1)
        elif isinstance(event, yaml.AliasEvent):
            if any(entry[2] == event.anchor for entry in self.open):
                name = event.anchor[:40]
                raise self.refuse(event, f"refers to itself (*{name} inside &{name}): a value must end")
            size = self.anchors.get(event.anchor, (1, 0))  # an unknown anchor: the composer says so
            self.total += size[0]
            anchor = None
        elif isinstance(event, yaml.ScalarEvent):
            size, anchor = (1, 0), event.anchor
            self.total += 1
        else:  # stream and document start and end
            return
        if anchor:
            self.anchors[anchor] = size
        if self.total > MAX_CONFIG_VALUES or len(self.open) + size[1] > MAX_CONFIG_DEPTH:
            raise self.too_big(event)
        if self.open:
            parent = self.open[-1]
            parent[0] += size[0]
            parent[1] = max(parent[1], size[1])
        if len(self.open) == 1 and self.top_mapping:
            self.children += 1
            if self.children % 2:  # a key: named in a refusal of its value
                text = event.value if isinstance(event, yaml.ScalarEvent) else "a key"
                self.key = (text if len(text) <= 100 else v.shown(text), event.start_mark.line + 1)


def check_config_size(cfg: ConfigFile) -> None:
    """Refuse ``cfg.text`` when its values are too many or nested too deeply (``_SizeCheck``),
    naming the top-level key; reads the YAML events only, so nothing is built."""
    check = _SizeCheck(cfg)
    for event in check.yaml.parse(cfg.text, Loader=check.yaml.SafeLoader):
        check.node(event)


def read_config_data(path: str | os.PathLike) -> Any:
    """A YAML file's data, read as :func:`load_config` reads it (bounded size, UTF-8, values
    bounded by ``check_config_size``) but with its keys unchecked."""
    yaml = _yaml()
    cfg = ConfigFile(path=Path(path))
    cfg.text = _read_config_text(cfg.path, None)
    try:
        check_config_size(cfg)
        return yaml.safe_load(cfg.text)
    except yaml.YAMLError as err:
        raise ValueError(f"{cfg.path} is not valid YAML: {err}") from None


def load_config(path: str | os.PathLike, source: str | None = None) -> ConfigFile:
    """Read and check a config file. Each launch setting is checked here (settings that must
    fit together are checked by :func:`resolve_settings`, after flags and environment);
    handler sections are checked for unknown keys here and for their values by
    :func:`build_handlers` (the handlers' own constructors). ``source`` (a flag or an
    environment variable) is named when the file cannot be read."""
    yaml = _yaml()
    cfg = ConfigFile(path=Path(path))
    cfg.text = _read_config_text(cfg.path, source)
    try:
        check_config_size(cfg)  # before anything is built from it: bounded values, bounded depth
        node = yaml.compose(cfg.text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(cfg.text)
    except yaml.YAMLError as err:
        raise ValueError(f"{cfg.path} is not valid YAML: {err}") from None
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ValueError(
            f"{cfg.path}, line 1: a config file must be a mapping of keys to values, got {type(data).__name__}"
        )
    _mapping_lines(cfg, node, ())
    allowed = [*LAUNCH_SETTINGS, *HANDLER_SECTIONS, "dynamo", "fsdp", "parallelism_config"]
    for key, value in data.items():
        where = cfg.where(str(key))
        if key in LAUNCH_SETTINGS:
            if value is not None:
                try:
                    cfg.launch[key] = LAUNCH_SETTINGS[key].check(value)
                except (TypeError, ValueError) as err:
                    raise type(err)(f"{where}: {err}") from None
        elif key in HANDLER_SECTIONS:
            cfg.sections[key] = _check_section(cfg, key, value)
        elif key in ("dynamo", "dynamo_config"):
            _dynamo_section(cfg, key, value)
        elif key in ("fsdp", "fsdp_config"):
            _fsdp_section(cfg, key, value)
        elif key == "parallelism_config":
            _prefixed_section(cfg, key, value, "parallelism_config_", "use_parallelism_config")
        else:
            raise _unknown(where, key, allowed, _allowed_top_keys())
    return cfg


def _dynamo_section(cfg: ConfigFile, section: str, value: Any) -> None:
    """``dynamo: {backend: inductor, mode: ..., use_regional_compilation: true}`` (Accelerate's
    ``dynamo_config:`` spells the keys ``dynamo_backend``, ...): the dynamo launch settings."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{cfg.where(section)}: section {section!r} must be a mapping, got {v.shown(value)}")
    for key, item in value.items():
        name = str(key) if str(key).startswith("dynamo_") else f"dynamo_{key}"
        if name.removeprefix("dynamo_") not in DYNAMO_SECTION_KEYS:
            raise _unknown(cfg.where(section, str(key)), key, list(DYNAMO_SECTION_KEYS),
                           f"{section}: {', '.join(DYNAMO_SECTION_KEYS)}")
        if item is not None:
            try:
                cfg.launch[name] = LAUNCH_SETTINGS[name].check(item)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{cfg.where(section, str(key))}: {err}") from None


def _fsdp_section(cfg: ConfigFile, section: str, value: Any) -> None:
    """``fsdp: {version: 2, auto_wrap_policy: ..., ...}`` (or Accelerate's ``fsdp_config:`` with
    ``fsdp_``-prefixed keys; its ``fsdp_transformer_layer_cls_to_wrap`` too): the --fsdp_* launch
    settings, and use_fsdp unless the file sets it."""
    _prefixed_section(cfg, section, value, "fsdp_", "use_fsdp")


def _prefixed_section(cfg: ConfigFile, section: str, value: Any, prefix: str, switch: str) -> None:
    """A section whose keys are launch settings named ``prefix + key`` (the prefix may be
    written too, as Accelerate's files do); it turns ``switch`` on unless the file sets it.
    ``parallelism_config: {dp_shard_size: 2, tp_size: 2}`` is ``--parallelism_config_dp_shard_size 2 ...``."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{cfg.where(section)}: section {section!r} must be a mapping, got {v.shown(value)}")
    keys = [n.removeprefix(prefix) for n in LAUNCH_SETTINGS if n.startswith(prefix)]
    for key, item in value.items():
        name = str(key) if str(key).startswith(prefix) else f"{prefix}{key}"
        if name not in LAUNCH_SETTINGS:
            raise _unknown(cfg.where(section, str(key)), key, keys, f"{section}: {', '.join(keys)}")
        if item is not None:
            try:
                cfg.launch[name] = LAUNCH_SETTINGS[name].check(item)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{cfg.where(section, str(key))}: {err}") from None
    cfg.launch.setdefault(switch, True)


def _handler_class(section: str) -> type:
    from . import handlers

    return getattr(handlers, HANDLER_SECTIONS[section])


def _check_section(cfg: ConfigFile, section: str, value: Any) -> dict[str, Any]:
    from dataclasses import fields

    cls = _handler_class(section)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(
            f"{cfg.where(section)}: section {section!r} must be a mapping of {cls.__name__} fields, "
            f"got {v.shown(value)}"
        )
    names = [f.name for f in fields(cls)]
    for key in value:
        if key not in names:
            raise _unknown(cfg.where(section, str(key)), key, names, f"{section} ({cls.__name__}): {', '.join(names)}")
    return dict(value)


def _field_value(cfg: ConfigFile, section: str, key: str, value: Any) -> Any:
    """Turn a YAML value into what the handler field takes (only where YAML cannot say it)."""
    if section == "process_group" and key == "timeout" and value is not None:
        from datetime import timedelta

        from .handlers import MAX_TIMEOUT, MIN_TIMEOUT

        try:  # bounded before timedelta() is built: 1e300 seconds would overflow it
            v.check_number(
                "process_group", "timeout", value, ge=MIN_TIMEOUT.total_seconds(), le=MAX_TIMEOUT.total_seconds()
            )
        except (TypeError, ValueError) as err:
            raise type(err)(f"{cfg.where(section, key)}: {err} (seconds)") from None
        return timedelta(seconds=value)
    return value


def _failing_line(cfg: ConfigFile, section: str, cls: type, message: str) -> str:
    """The line of the key a handler's error names (handlers name fields as ``Class.field``)."""
    hits = [
        (message.find(f"{cls.__name__}.{key}"), key)
        for key in cfg.sections[section]
        if f"{cls.__name__}.{key}" in message
    ]
    if not hits:
        return cfg.where(section)
    key = min(hits)[1]
    nested = cfg.sections[section][key]
    if isinstance(nested, dict):  # e.g. comm_state_option's own keys
        for sub in nested:
            if repr(sub) in message and (section, key, str(sub)) in cfg.lines:
                return cfg.where(section, key, str(sub))
    return cfg.where(section, key)


def build_handlers(cfg: ConfigFile) -> list[Any]:
    """The kwargs handlers of the file's sections, built (and so checked) by their own classes."""
    built = []
    for section, values in cfg.sections.items():
        cls = _handler_class(section)
        kwargs = {key: _field_value(cfg, section, key, value) for key, value in values.items()}
        try:
            built.append(cls(**kwargs))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{_failing_line(cfg, section, cls, str(err))}: [{section}] {err}") from None
    return built


def handlers_from_file(path: str | os.PathLike, source: str | None = None) -> list[Any]:
    return build_handlers(load_config(path, source))


def handlers_from_env() -> list[Any]:
    """Handlers of the file named by ``$HASTEN_CONFIG_FILE`` (none when it is unset)."""
    path = env.get(env.HASTEN_CONFIG_FILE)
    return handlers_from_file(path, env.HASTEN_CONFIG_FILE) if path else []


# ----------------------------------------------------------------------------- effective settings


def resolve_settings(
    flags: Mapping[str, Any],
    cfg: ConfigFile | None,
    environ: Mapping[str, str] | None = None,
    detected: Mapping[str, tuple[Any, str]] | None = None,
) -> dict[str, tuple[Any, str]]:
    """Every launch setting with its value and where it came from.

    Precedence: flag > ``detected`` (a SLURM step's settings, with their variables) >
    HASTEN_* environment variable > config file > default.
    """
    environ = env.current() if environ is None else environ
    detected = detected or {}
    result: dict[str, tuple[Any, str]] = {}
    for name, setting in LAUNCH_SETTINGS.items():
        raw_env = environ.get(setting.env) if setting.env else None
        if flags.get(name) is not None:
            result[name] = (flags[name], "flag")
        elif name in detected:
            value, variable = detected[name]
            result[name] = (setting.check(value), f"environment {variable}")
        elif raw_env not in (None, ""):
            result[name] = (_env_value(name, raw_env), f"environment {setting.env}")
        elif cfg is not None and name in cfg.launch:
            result[name] = (cfg.launch[name], "config file")
        else:
            result[name] = (setting.default, "default")
    try:
        check_launch_settings({k: val for k, (val, _) in result.items()})
    except SettingsError as err:
        source = result[err.key][1]
        if source == "config file" and cfg is not None:
            source = f"config file {cfg.where(err.key)}"
        raise SettingsError(err.key, f"{err} ({err.key} from the {source})") from None
    return result


# ----------------------------------------------------------------------------- writing

_HEADER = """\
# hasten config file (written by `hasten config`). `hasten launch` reads it; its flags win.
# Handler sections may be added, one per kwargs handler, with that handler's field names:
#   ddp: {bucket_cap_mb: 50, comm_hook: fp16}   # DistributedDataParallelKwargs
#   autocast: {cache_enabled: false}            # AutocastKwargs
#   grad_scaler: {init_scale: 1024}             # GradScalerKwargs
#   profile: {activities: [cpu]}                # ProfileKwargs
#   process_group: {timeout: 900}               # InitProcessGroupKwargs (seconds)
"""


def write_config(path: str | os.PathLike, launch: Mapping[str, Any], sections: Mapping[str, Any] | None = None) -> Path:
    """Write launch settings (checked first) and handler sections as YAML; return the path."""
    yaml = _yaml()
    data: dict[str, Any] = {}
    for name, value in launch.items():
        if name not in LAUNCH_SETTINGS:
            raise ValueError(f"unknown launch setting {name!r}; allowed: {', '.join(LAUNCH_SETTINGS)}")
        data[name] = None if value is None else LAUNCH_SETTINGS[name].check(value)
    check_launch_settings({k: val for k, val in data.items() if val is not None})
    data.update(sections or {})
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(_HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False), encoding="utf-8")
    os.replace(tmp, target)
    return target
