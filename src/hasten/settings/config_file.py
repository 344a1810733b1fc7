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

Sections of launch settings group their keys as Accelerate's files do: ``dynamo:``/``dynamo_config:``,
``fsdp:``/``fsdp_config:``, ``parallelism_config:`` and ``fp8_config:`` (or ``fp8:``), whose keys
(``backend``, ``fp8_format``, ``margin``, ``opt_level``, ``pad_inner_dim``, ...) are the ``--fp8_*``
settings; ``hasten launch`` exports them as the ``ACCELERATE_FP8_*`` variables the fp8 recipe
handlers read.

A file in Accelerate's format (what ``accelerate config`` writes, and the files recipes ship for
``accelerate launch --config_file``: it has ``distributed_type`` or ``compute_environment``) is
translated into the same launch settings by :mod:`hasten.settings.accelerate_config`; which format a
file is in is decided once, from its top-level keys.

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
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hasten import _validate as v
from hasten.settings import accelerate_config
from hasten.settings import environment as env
from hasten.settings.accelerate_config import FP8_KEY_ALIASES, accelerate_default_config_path, is_accelerate_format
from hasten.settings.launch_settings import (
    DYNAMO_SECTION_KEYS,
    LAUNCH_SETTINGS,
    SPLIT_SETTINGS,
    SettingsError,
    _env_value,
    check_launch_settings,
)

DEFAULT_CONFIG_NAME = "default_config.yaml"
# A config file holds a few dozen lines; YAML takes minutes on a file of 100 MB.
MAX_CONFIG_BYTES = 1 << 20
# Values in a whole file (each use of a YAML alias counted again) and levels of nesting: a real
# file has a few dozen values and three levels (file, section, a field's mapping).
MAX_CONFIG_VALUES = 5000
MAX_CONFIG_DEPTH = 20

# Section name -> handler class name in hasten.settings.handlers (imported when a file is built).
HANDLER_SECTIONS: dict[str, str] = {
    "ddp": "DistributedDataParallelKwargs",
    "autocast": "AutocastKwargs",
    "grad_scaler": "GradScalerKwargs",
    "profile": "ProfileKwargs",
    "process_group": "InitProcessGroupKwargs",
}

# fp8_config's keys as its error lists them: the --fp8_* settings without the prefix, except
# fp8_format (the TE field's own name; `format` is accepted too), then Accelerate's other names.
FP8_SECTION_KEYS: tuple[str, ...] = (
    "backend",
    "fp8_format",
    "margin",
    "interval",
    "amax_history_len",
    "amax_compute_algo",
    "override_linear_precision",
    "use_autocast_during_eval",
    "use_mxfp8_block_scaling",
    "opt_level",
    "pad_inner_dim",
    "enable_fsdp_float8_all_gather",
    *(alias.removeprefix("fp8_") for alias in FP8_KEY_ALIASES),
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
    """The config file in use: ``explicit``, else ``$HASTEN_CONFIG_FILE``, else hasten's default
    path when that file exists, else Accelerate's default config file when that one exists
    (:func:`is_accelerate_default` tells). A file named explicitly or by the variable must exist."""
    for source, value in (("--config_file", explicit), (env.HASTEN_CONFIG_FILE, env.get(env.HASTEN_CONFIG_FILE))):
        if value:
            path = Path(value).expanduser().resolve()
            check_config_path(path, source)
            return path
    for path in (default_config_path(), accelerate_default_config_path()):
        if path.is_file():
            return path.resolve()
    return None


def is_accelerate_default(path: Path | None) -> bool:
    """Whether ``path`` (from :func:`find_config_file`) is Accelerate's default config file, read
    because hasten's own default file does not exist."""
    if path is None:
        return False
    theirs = accelerate_default_config_path()
    return theirs.is_file() and path == theirs.resolve() and not default_config_path().is_file()


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
        raise ValueError(
            f"{where} is a folder, not a file: name the YAML file itself, e.g. {str(path / DEFAULT_CONFIG_NAME)!r}"
        )
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
    #: "hasten", or "accelerate" (Accelerate's format, see hasten.settings.accelerate_config)
    format: str = "hasten"
    notes: list[str] = field(default_factory=list)  # what hasten launch and hasten config show say about it
    inert: list[str] = field(default_factory=list)  # its keys that do nothing here (hasten config show)
    gpu_ids: str | None = None  # Accelerate's gpu_ids ("all": None)
    debug: bool = False  # Accelerate's debug: collectives check their shapes (HASTEN_DEBUG_MODE)

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
    close = [accelerate_config.SETTING_NAMES[key]] if key in accelerate_config.SETTING_NAMES else []
    close = close or difflib.get_close_matches(str(key), allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if str(key) in accelerate_config.TOP_LEVEL_KEYS:
        hint += (
            f" ({key!r} is a key of Accelerate's format, which a file is in when it has distributed_type or "
            "compute_environment; this one has neither, so it is read in hasten's format.)"
        )
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
    :func:`build_handlers` (the handlers' own constructors). A file in Accelerate's format is
    translated (:func:`hasten.settings.accelerate_config.translate`) and has no handler sections.
    ``source`` (a flag or an environment variable) is named when the file cannot be read."""
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
    if is_accelerate_format(data):  # decided once, from the top-level keys, for the whole file
        _accelerate_file(cfg, data)
        return cfg
    allowed = [*LAUNCH_SETTINGS, *HANDLER_SECTIONS, "dynamo", "fsdp", "parallelism_config", "fp8_config"]
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
        elif key in ("fp8", "fp8_config"):
            _prefixed_section(cfg, key, value, "fp8_", None, FP8_KEY_ALIASES, FP8_SECTION_KEYS)
        else:
            raise _unknown(where, key, allowed, _allowed_top_keys())
    return cfg


def _accelerate_file(cfg: ConfigFile, data: dict[str, Any]) -> None:
    """A file in Accelerate's format: its launch settings translated (and checked) by
    :func:`hasten.settings.accelerate_config.translate`; errors about a setting point at the key it came from."""
    got = accelerate_config.translate(data, cfg.path, cfg.lines)
    cfg.format = "accelerate"
    cfg.launch = got.launch
    cfg.notes, cfg.inert, cfg.gpu_ids, cfg.debug = got.notes, got.inert, got.gpu_ids, got.debug
    for name, keys in got.origin.items():
        if keys in cfg.lines:
            cfg.lines[(name,)] = cfg.lines[keys]


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
            raise _unknown(
                cfg.where(section, str(key)),
                key,
                list(DYNAMO_SECTION_KEYS),
                f"{section}: {', '.join(DYNAMO_SECTION_KEYS)}",
            )
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


def _prefixed_section(
    cfg: ConfigFile,
    section: str,
    value: Any,
    prefix: str,
    switch: str | None,
    aliases: Mapping[str, str] | None = None,
    shown: tuple[str, ...] | None = None,
) -> None:
    """A section whose keys are launch settings named ``prefix + key`` (the prefix may be
    written too, as Accelerate's files do; ``aliases`` maps other spellings to a setting, ``shown``
    are the keys an error lists); it turns ``switch`` on unless the file sets it (None: there is none).
    ``parallelism_config: {dp_shard_size: 2, tp_size: 2}`` is ``--parallelism_config_dp_shard_size 2 ...``."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{cfg.where(section)}: section {section!r} must be a mapping, got {v.shown(value)}")
    aliases = aliases or {}
    keys = list(shown or (n.removeprefix(prefix) for n in LAUNCH_SETTINGS if n.startswith(prefix)))
    for key, item in value.items():
        name = str(key) if str(key).startswith(prefix) else f"{prefix}{key}"
        name = aliases.get(name, name)
        if name not in LAUNCH_SETTINGS:
            raise _unknown(cfg.where(section, str(key)), key, keys, f"{section}: {', '.join(keys)}")
        if item is not None:
            try:
                cfg.launch[name] = LAUNCH_SETTINGS[name].check(item)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{cfg.where(section, str(key))}: {err}") from None
    if switch is not None:
        cfg.launch.setdefault(switch, True)


def _handler_class(section: str) -> type:
    from hasten.settings import handlers

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

        from hasten.settings.handlers import MAX_TIMEOUT, MIN_TIMEOUT

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
        elif name in SPLIT_SETTINGS and any(environ.get(n) for n in SPLIT_SETTINGS[name]):
            parts = ["true" if env.env_flag(n, environ=environ) else "false" for n in SPLIT_SETTINGS[name]]
            result[name] = (",".join(parts), f"environment {', '.join(SPLIT_SETTINGS[name])}")
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
    """Write launch settings (checked first) and handler sections as YAML; return the path. A setting
    whose value is None is left out of the file (:func:`load_config` reads a missing key and a null alike)."""
    yaml = _yaml()
    data: dict[str, Any] = {}
    for name, value in launch.items():
        if name not in LAUNCH_SETTINGS:
            raise ValueError(f"unknown launch setting {name!r}; allowed: {', '.join(LAUNCH_SETTINGS)}")
        if value is not None:
            data[name] = LAUNCH_SETTINGS[name].check(value)
    check_launch_settings(data)
    data.update(sections or {})
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(_HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False), encoding="utf-8")
    os.replace(tmp, target)
    return target
