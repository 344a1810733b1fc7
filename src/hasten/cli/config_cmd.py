"""``hasten config``: write the config file (asking, or ``--default``) and ``config show``.

Torch-free: the number of GPUs offered as the questions' defaults is read from the NVIDIA driver's
``/proc`` entries and ``CUDA_VISIBLE_DEVICES``, not from torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hasten import _validate as v
from hasten.cli._flags import Parser, add_config_file_flag, add_setting_flags, given_settings
from hasten.settings import environment
from hasten.settings.accelerate_config import accelerate_default_config_path, apply_fsdp1
from hasten.settings.choices import MIXED_PRECISION_CHOICES
from hasten.settings.config_file import (
    HANDLER_SECTIONS,
    ConfigFile,
    build_handlers,
    default_config_path,
    find_config_file,
    is_accelerate_default,
    load_config,
    read_config_data,
    resolve_settings,
    write_config,
)
from hasten.settings.launch_settings import LAUNCH_SETTINGS, check_launch_settings, parse_setting_text


def add_config_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "config",
        help="write a config file for `hasten launch` (asks a few questions; --default asks none)",
        description=(
            "Without arguments, ask a few questions and save the answers as YAML at "
            f"$HASTEN_CONFIG_HOME/default_config.yaml (default: {default_config_path()}), "
            "or at --config_file. Flags preset the answers. `hasten config show` prints the "
            "effective configuration: flags > HASTEN_* environment > config file > defaults."
        ),
    )
    parser.add_argument("action", nargs="?", choices=["show"], help="show: print the effective configuration")
    parser.add_argument(
        "--default", action="store_true",
        help="write the file without asking, with the defaults the questions offer (flags still apply)",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true",
        help="replace an existing file without asking (without it, --default refuses to, and the questions ask first)",
    )  # fmt: skip
    add_config_file_flag(parser, "file to write (or, with `show`, to read) instead of the default")
    add_setting_flags(parser)
    parser.set_defaults(config_parser=parser)


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch (NVIDIA driver entries on Linux)."""
    visible = environment.get(environment.CUDA_VISIBLE_DEVICES)
    try:
        installed = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        installed = 0
    if visible is None:
        return installed
    entries = [e for e in visible.split(",") if e.strip()]
    valid = []
    for entry in entries:  # CUDA stops at the first invalid entry
        if entry.strip().startswith("-"):
            break
        valid.append(entry)
    return min(len(valid), installed)


def config_command(args: argparse.Namespace) -> int:
    try:
        if args.action == "show":
            return show(args)
        return write(args)
    except BrokenPipeError:  # stdout closed (`hasten config show | head`): main() ends quietly
        raise
    except (OSError, TypeError, ValueError, ImportError) as err:
        args.config_parser.error(str(err))
    return 2  # pragma: no cover - error() exits


# ----------------------------------------------------------------------------- writing


def _ask(question: str, name: str, default: Any, read: Callable[[str], str]) -> Any:
    shown = ("yes" if default else "no") if isinstance(default, bool) else ("" if default is None else default)
    while True:
        try:
            answer = read(f"{question} [{shown}]: ").strip()
        except EOFError:
            raise ValueError(f"no answer to {question!r} (end of input); nothing was written") from None
        if not answer:
            return default
        try:
            return parse_setting_text(name, answer)
        except (TypeError, ValueError) as err:
            print(f"  {err}", file=sys.stderr)


def _cpu_default(preset: dict[str, Any], gpus: int) -> bool:
    """The flag when given, else whether this machine has no GPU (the questions' default and --default's)."""
    return bool(preset["cpu"]) if preset["cpu"] is not None else gpus == 0


def _may_replace(target: Path, args: argparse.Namespace, read: Callable[[str], str]) -> bool:
    """Whether an existing ``target`` may be replaced: --force, else (asking) a yes; --default refuses."""
    if not target.exists() or getattr(args, "force", False):
        return True
    if args.default:
        raise ValueError(f"{target} exists; nothing was written. Pass --force to replace it (or --config_file PATH)")
    try:
        answer = read(f"{target} exists. Replace it (yes/no)? [no]: ").strip()
    except EOFError:
        raise ValueError(f"{target} exists and no answer came (end of input); nothing was written") from None
    try:
        return v.parse_bool_text("the answer", answer, true=("y",), false=("n",)) if answer else False
    except ValueError:
        return False


def _questions(preset: dict[str, Any], gpus: int, read: Callable[[str], str]) -> dict[str, Any]:
    """Ask for each setting; the defaults shown are the flags given, else what this machine has."""
    s = dict(preset)
    s["num_machines"] = _ask("How many machines?", "num_machines", s["num_machines"], read)
    if s["num_machines"] > 1:
        while True:
            s["machine_rank"] = _ask(
                "Rank of this machine (0 is the main one)?", "machine_rank", s["machine_rank"], read
            )
            if s["machine_rank"] < s["num_machines"]:
                break
            print(f"  machine_rank must be in 0 .. {s['num_machines'] - 1}", file=sys.stderr)
        s["main_process_ip"] = _ask("IP address of machine 0?", "main_process_ip", s["main_process_ip"], read)
        s["main_process_port"] = _ask("Port on machine 0?", "main_process_port", s["main_process_port"] or 29500, read)
        s["rdzv_backend"] = _ask("Rendezvous backend (static or c10d)?", "rdzv_backend", s["rdzv_backend"], read)
    else:
        s["machine_rank"] = 0
    s["cpu"] = _ask("Train on CPU only (yes/no)?", "cpu", _cpu_default(preset, gpus), read)
    per_machine = 1 if s["cpu"] else max(gpus, 1)
    processes = s["num_processes"] or per_machine * s["num_machines"]
    while True:
        s["num_processes"] = _ask("How many processes in total?", "num_processes", processes, read)
        if s["num_processes"] % s["num_machines"] == 0:
            break
        print(f"  num_processes must be a multiple of num_machines={s['num_machines']}", file=sys.stderr)
    mp = _ask(
        f"Mixed precision ({'/'.join(MIXED_PRECISION_CHOICES)})?", "mixed_precision", s["mixed_precision"] or "no", read
    )
    s["mixed_precision"] = None if mp == "no" and preset["mixed_precision"] is None else mp
    steps = _ask(
        "Gradient accumulation steps?", "gradient_accumulation_steps", s["gradient_accumulation_steps"] or 1, read
    )
    s["gradient_accumulation_steps"] = None if steps == 1 and preset["gradient_accumulation_steps"] is None else steps
    return s


def write(args: argparse.Namespace, read: Callable[[str], str] = input) -> int:
    """Write the config file: only the settings that are set (a key left out and a null read alike).
    Without answers (--default), the flags given and ``cpu``: num_processes then means one per GPU
    (decided by `hasten launch`, which asks torch), mixed precision and accumulation steps are left to
    the script's code, the rest to hasten's defaults."""
    target = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    preset: dict[str, Any] = {name: s.default for name, s in LAUNCH_SETTINGS.items()}
    preset.update({name: None for name, s in LAUNCH_SETTINGS.items() if s.env and name != "cpu"})
    preset["cpu"] = None
    given = {name: value for name, value in given_settings(args).items() if value is not None}
    preset.update(given)
    if not _may_replace(target, args, read):
        print(f"hasten config: kept {target} as it was (--force replaces it without asking)")
        return 0
    gpus = visible_gpu_count()
    settings = {**given, "cpu": None} if args.default else _questions(preset, gpus, read)
    if args.default:
        settings["cpu"] = _cpu_default(preset, gpus)  # what the question offers, so both files agree
    settings["cpu"] = bool(settings["cpu"])
    check_launch_settings(settings)

    sections: dict[str, Any] = {}
    if target.is_file():  # keep the handler sections of the file being replaced
        try:
            old = read_config_data(target)
        except ValueError as err:
            raise ValueError(f"{target} exists but cannot be read ({err}); fix or delete it first") from None
        if isinstance(old, dict):
            sections = {k: val for k, val in old.items() if k in HANDLER_SECTIONS}
    path = write_config(target, settings, sections)
    print(f"hasten config: saved to {path}")
    if sections:
        print(f"hasten config: kept the handler sections {', '.join(sections)} of the previous file")
    env_file = environment.get(environment.HASTEN_CONFIG_FILE)
    if env_file and Path(env_file).expanduser().resolve() != path.resolve():
        print(
            f"hasten config: note: {environment.HASTEN_CONFIG_FILE}={env_file} is set, so `hasten launch` reads that "
            "file instead"
        )
    return 0


# ----------------------------------------------------------------------------- show


def _scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def show(args: argparse.Namespace) -> int:
    import yaml

    path = find_config_file(args.config_file)
    cfg = load_config(path) if path is not None else None
    if cfg is not None:
        build_handlers(cfg)  # check the handler sections as the Accelerator will
    resolved = resolve_settings(given_settings(args), cfg)
    fsdp1 = apply_fsdp1(resolved, resolved["num_processes"][0])
    _check_as_launch(resolved, cfg)
    _file_header(path, cfg)
    for note in [*(cfg.notes if cfg is not None else []), *fsdp1]:
        print(f"# note: {note}")
    print("# precedence: flag > HASTEN_* environment > config file > default")
    width = max(len(f"{n}: {_scalar(val)}") for n, (val, _) in resolved.items())
    for name, (value, source) in resolved.items():
        if name == "num_processes" and value is None:
            source = "default: one per GPU on each machine, 1 without GPUs or with cpu"
        elif value is None:
            source += " (not set)"
        print(f"{f'{name}: {_scalar(value)}':<{width}}  # {source}")
    for section, values in cfg.sections.items() if cfg is not None else ():
        print(f"# handler section {section!r} -> {HANDLER_SECTIONS[section]}, from the config file")
        print(yaml.safe_dump({section: values}, sort_keys=False, default_flow_style=False).rstrip())
    for line in cfg.inert if cfg is not None else ():
        print(f"# does nothing here: {line}")
    return 0


def _check_as_launch(resolved: dict[str, tuple[Any, str]], cfg: ConfigFile | None) -> None:
    """Build the plugins from these settings as ``hasten launch`` does before it starts a worker, so
    ``config show`` never calls a file fine that ``hasten launch`` refuses (its error, its exit status).
    The environment is exported for that check only, and restored."""
    from hasten.cli.launch import check_plugin_settings, export_settings

    with environment.kept(("",)):  # every variable as it was, afterwards
        export_settings(resolved, cfg)
        settings = {name: value for name, (value, _) in resolved.items()}
        if settings["num_processes"] is None:
            settings["num_processes"] = settings["num_machines"]  # the count launch picks without GPUs
        check_plugin_settings(Parser(prog="hasten config show"), settings, resolved)


def _file_header(path: Path | None, cfg: ConfigFile | None) -> None:
    """Which config file is used, and in which format."""
    if path is None or cfg is None:
        print(
            f"# config file: none (neither hasten's default {default_config_path()} nor Accelerate's "
            f"{accelerate_default_config_path()} exists)"
        )
        return
    if is_accelerate_default(path):
        print(
            f"# config file: {path} (Accelerate's default config file; hasten's own {default_config_path()} "
            "does not exist)"
        )
    else:
        print(f"# config file: {path}")
    if cfg.format == "accelerate":
        extra = f"; gpu_ids {cfg.gpu_ids} -> CUDA_VISIBLE_DEVICES" if cfg.gpu_ids else ""
        extra += "; debug: collectives check their shapes (HASTEN_DEBUG_MODE)" if cfg.debug else ""
        print(f"# format: Accelerate's (it has distributed_type), translated to hasten's settings{extra}")
