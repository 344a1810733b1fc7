"""``hasten launch``: start a training script on N processes with ``torch.distributed.run``.

The launcher is thin: it settles the launch settings (flags > ``HASTEN_*`` environment >
config file > defaults), exports what the script's ``Accelerator()`` reads
(``HASTEN_MIXED_PRECISION``, ``HASTEN_GRADIENT_ACCUMULATION_STEPS``, ``HASTEN_USE_CPU``,
``HASTEN_CONFIG_FILE``), translates the rest into ``torch.distributed.run`` arguments and
runs torch's elastic agent in this process. Each worker runs ``hasten.cli._child``, which
runs the script as ``python script.py`` would and records an uncaught exception in torch's
error file, so the launcher can say which rank failed first and why.

With one process on one machine (and no restarts) the launcher replaces itself with
``python script.py ...`` (``os.execv``): the run is exactly a plain Python run, plus the
exported settings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from ..choices import ENV_CONFIG_FILE
from ..config import LAUNCH_SETTINGS, ConfigFile, build_handlers, find_config_file, load_config, resolve_settings
from ._flags import add_config_file_flag, add_setting_flags, given_settings

USAGE = "hasten launch [options] [--] (script.py | -m module) [script arguments ...]"
CHILD_MODULE = "hasten.cli._child"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hasten launch",
        usage=USAGE,
        allow_abbrev=False,
        description=(
            "Start a training script on several processes (and machines) with torch.distributed.run. "
            "Everything after the script name is passed to the script unchanged; a `--` before the "
            "script name ends hasten's options. Settings come from the flags, then the HASTEN_* "
            "environment variables, then the config file (see `hasten config`)."
        ),
    )
    parser.add_argument(
        "-m", "--module", dest="module", action="store_true", help="run the script argument as a module (python -m)"
    )
    add_config_file_flag(
        parser, "config file to read (default: $HASTEN_CONFIG_FILE, else the file written by `hasten config`)"
    )
    add_setting_flags(parser)
    return parser


def split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split into hasten's options and [script, script args...]: the script is the first
    token that is neither an option nor an option's value, or the token after ``--``."""
    no_value = {s for a in parser._actions if a.nargs == 0 for s in a.option_strings}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        i += 1 if ("=" in token or token in no_value) else 2
    return list(argv), []


def _default_num_processes(settings: dict[str, Any]) -> int:
    """One process per GPU on each machine; 1 per machine without GPUs or with --cpu."""
    per_machine = 1
    if not settings["cpu"]:
        import torch

        per_machine = max(1, torch.cuda.device_count())
    return per_machine * settings["num_machines"]


def _check_target(parser: argparse.ArgumentParser, target: str, module: bool) -> None:
    if not module:
        if not os.path.exists(target):
            parser.error(f"training script {target!r} not found (looked for {os.path.abspath(target)!r})")
        return
    import importlib.util

    sys.path.insert(0, os.getcwd())  # `python -m` looks in the working directory first
    try:
        found = importlib.util.find_spec(target) is not None
    except ModuleNotFoundError:
        found = False
    except Exception:  # noqa: BLE001 - a parent package that fails to import: the worker will say why
        found = True
    finally:
        sys.path.pop(0)
    if not found:
        parser.error(f"module {target!r} not found (run with -m from {os.getcwd()!r})")


def export_settings(settings: dict[str, tuple[Any, str]], cfg: ConfigFile | None) -> None:
    """Set the environment variables the script's Accelerator() reads (only settings that were given)."""
    for name, (value, source) in settings.items():
        env = LAUNCH_SETTINGS[name].env
        if env and source != "default":
            os.environ[env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    if cfg is not None:
        os.environ[ENV_CONFIG_FILE] = str(cfg.path)


def torch_run_args(s: dict[str, Any], target: str, module: bool, script_args: list[str]) -> list[str]:
    """The ``torch.distributed.run`` command line for settled settings ``s``."""
    machines = s["num_machines"]
    args = [
        f"--nnodes={machines}",
        f"--nproc-per-node={s['num_processes'] // machines}",
        f"--rdzv-backend={s['rdzv_backend']}",
        f"--max-restarts={s['max_restarts']}",
        f"--monitor-interval={s['monitor_interval']}",
    ]
    ip, port = s["main_process_ip"], s["main_process_port"]
    if s["rdzv_backend"] == "static":
        # On one machine without a port, torch.distributed.run picks a free one itself.
        if machines > 1 or port is not None:
            args += [f"--node-rank={s['machine_rank']}", f"--master-addr={ip or '127.0.0.1'}"]
            args.append(f"--master-port={port or 29500}")
    else:
        default_port = 29400 if machines > 1 else 0
        args += [f"--rdzv-endpoint={ip or 'localhost'}:{port or default_port}", "--rdzv-id=hasten"]
    args += ["--module", CHILD_MODULE, *(["-m", target] if module else [target]), *script_args]
    return args


def launch_command(argv: Sequence[str]) -> int:
    parser = build_parser()
    own, rest = split_argv(parser, argv)
    args = parser.parse_args(own)
    if not rest:
        parser.error("the training script is missing: " + USAGE)
    target, script_args = rest[0], rest[1:]
    try:
        path = find_config_file(args.config_file)
        cfg = load_config(path) if path is not None else None
        if cfg is not None:
            build_handlers(cfg)  # a bad handler section fails here, before any process starts
        resolved = resolve_settings(given_settings(args), cfg)
    except (OSError, TypeError, ValueError, ImportError) as err:
        parser.error(str(err))
    _check_target(parser, target, args.module)
    settings = {name: value for name, (value, _) in resolved.items()}
    if settings["num_processes"] is None:
        settings["num_processes"] = _default_num_processes(settings)
        resolved["num_processes"] = (settings["num_processes"], "default")
        if settings["num_processes"] % settings["num_machines"]:  # pragma: no cover - defaults divide
            parser.error("num_processes must be a multiple of num_machines")
    export_settings(resolved, cfg)

    if settings["num_processes"] == 1 and settings["num_machines"] == 1 and settings["max_restarts"] == 0:
        # One process: be `python script.py` exactly (same process, signals and exit status).
        sys.stdout.flush()
        sys.stderr.flush()
        command = [sys.executable, *(["-m", target] if args.module else [target]), *script_args]
        os.execv(sys.executable, command)
    return run_workers(torch_run_args(settings, target, args.module, script_args))


def run_workers(torch_args: list[str]) -> int:
    """Run torch's elastic agent here; turn a worker failure or a signal into an exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torch's agent writes the workers' error files under a log directory it never removes.
    log_dir = tempfile.mkdtemp(prefix="hasten-launch-")
    try:
        run(get_args_parser().parse_args([f"--log-dir={log_dir}", *torch_args]))
    except ChildFailedError as err:
        message, status = describe_failure(err)
        print(message, file=sys.stderr, flush=True)
        return status
    except SignalException as err:
        name = signal.Signals(err.sigval).name
        print(f"hasten launch: stopped by {name}; all workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the workers started (e.g. waiting for other machines)
        print("hasten launch: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _traceback_of(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message", "")).rstrip()
    if isinstance(message, str) and "pytorch.org/docs" not in message:
        return message.rstrip()
    return ""


def _how(failure: Any) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
    return f"exited with code {failure.exitcode}"


def _failed_at(failure: Any) -> float:
    """When a worker failed: the sub-second time hasten's worker wrapper recorded; else the end
    of the second torch noted (whole seconds, taken when the agent saw the failure)."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    if "hasten_time" in extra:
        return float(extra["hasten_time"])
    return failure.timestamp + 0.999


def describe_failure(err: Any) -> tuple[str, int]:
    """A readable account of a ChildFailedError and the launcher's exit status."""
    failures = err.failures
    # Earliest first; at equal times a real error beats a rank killed by a signal.
    rank, first = min(failures.items(), key=lambda kv: (_failed_at(kv[1]), kv[1].exitcode < 0, kv[0]))
    lines = [
        f"hasten launch: rank {rank} failed first: it {_how(first)} "
        f"(local rank {first.local_rank}, pid {first.pid})"
    ]
    trace = _traceback_of(first)
    if trace:
        lines += [f"---- traceback of rank {rank} ----", trace, "----"]
    for other, failure in sorted(failures.items()):
        if other != rank:
            lines.append(f"hasten launch: rank {other} also failed: it {_how(failure)}")
    lines.append("hasten launch: the other workers were stopped")
    code = first.exitcode
    status = code if 0 < code < 256 else (128 - code if code < 0 else 1)
    return "\n".join(lines), status
