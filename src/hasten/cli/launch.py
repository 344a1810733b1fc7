"""``hasten launch``: start a training script on N processes with ``torch.distributed.run``.

The launcher is thin: it settles the launch settings (flags > ``HASTEN_*`` environment >
config file > defaults), exports what the script's ``Accelerator()`` reads
(``HASTEN_MIXED_PRECISION``, ``HASTEN_GRADIENT_ACCUMULATION_STEPS``, ``HASTEN_USE_CPU``,
``HASTEN_CONFIG_FILE``), translates the rest into ``torch.distributed.run`` arguments and
runs torch's elastic agent in this process. Each worker runs ``hasten.cli._child``, which
runs the script as ``python script.py`` would and records an uncaught exception in torch's
error file, so the launcher can say which rank failed first and why, and writes its stack when
stopped, so the launcher can say which rank did not reach a collective (``hasten.cli._stacks``).

With one process on one machine (and no restarts) the launcher replaces itself with
``python -m hasten._main script.py ...`` (``os.execv``): the run is a plain Python run (same
process, signals, exit status, ``sys.argv`` and ``sys.path[0]``), plus the exported settings and
hasten's console filters installed before the script imports anything.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from hasten._validate import positive_int_argument
from hasten.cli import _accelerate, _slurm, _torchrun_env
from hasten.cli._failures import ContinueStopped, _CtrlC, describe_failure, rendezvous_failure_message, stopped_report
from hasten.cli._flags import Parser, add_config_file_flag, add_setting_flags, given_settings
from hasten.settings import environment
from hasten.settings.accelerate_config import apply_fsdp1
from hasten.settings.config_file import (
    ConfigFile,
    build_handlers,
    default_config_path,
    find_config_file,
    is_accelerate_default,
    load_config,
    resolve_settings,
)
from hasten.settings.launch_settings import LAUNCH_SETTINGS, SettingsError, export_file_sources, setting_variables
from hasten.settings.locations import redact
from hasten.settings.parallelism import export_parallelism_switch

USAGE = "hasten launch [options] [--] (script.py | -m module) [script arguments ...]"
CHILD_MODULE = "hasten.cli._child"
# More processes per machine than this many per core (or per GPU), or than MAX_PROCESSES_PER_MACHINE
# on any machine, is refused as a typo.
MAX_PROCESSES_PER_CORE = 8
MAX_PROCESSES_PER_MACHINE = 1024


def _gpu_ids(text: str) -> str:
    ids = [part.strip() for part in text.split(",")]
    if text.strip().lower() != "all" and not all(part.isdigit() for part in ids):
        raise argparse.ArgumentTypeError(f"--gpu_ids must be 'all' or GPU numbers such as 0,1, got {text!r}")
    return text.strip()


def _alias_type(name: str):  # noqa: ANN202 - an argparse type
    from hasten.settings.launch_settings import parse_setting_text

    def parse(text: str) -> Any:
        try:
            return parse_setting_text(name, text)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _nnodes(text: str) -> tuple[int, int | None]:
    """``N`` or ``MIN:MAX`` (torchrun's --nnodes)."""
    low, colon, high = text.partition(":")
    try:
        lo, hi = int(low), (int(high) if colon else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes must be N or MIN:MAX such as 2 or 1:4, got {text!r}") from None
    if lo < 1 or (hi is not None and hi < lo):
        raise argparse.ArgumentTypeError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _endpoint(text: str) -> tuple[str, int | None]:
    host, colon, port = text.strip().rpartition(":")
    if not colon:
        host, port = text.strip(), ""
    if not host or (port and not port.isdigit()) or (port and not 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(
            f"--rdzv_endpoint must be HOST or HOST:PORT with a port in 1..65535 such as 10.0.0.1:29400, got {text!r}"
        )
    return host, int(port) if port else None


def torchrun_spellings(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Fold torchrun's flags into ``given`` (Accelerate's names); both spellings with other values is an error."""

    def put(name: str, value: Any, flag: str) -> None:
        if value is None:
            return
        if given.get(name) is not None and given[name] != value:
            parser.error(f"{flag} {value} and --{name} {given[name]} disagree: give one of them")
        given[name] = value

    if args.nnodes is not None:
        lo, hi = args.nnodes
        put("num_machines", lo, "--nnodes")
        put("max_machines", hi, "--nnodes")
    put("machine_rank", args.node_rank, "--node_rank")
    put("main_process_ip", args.master_addr, "--master_addr")
    put("main_process_port", args.master_port, "--master_port")
    if args.rdzv_endpoint is not None:
        put("main_process_ip", args.rdzv_endpoint[0], "--rdzv_endpoint")
        put("main_process_port", args.rdzv_endpoint[1], "--rdzv_endpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="hasten launch",
        usage=USAGE,
        allow_abbrev=False,
        description=(
            "Start a training script on several processes (and machines) with torch.distributed.run. "
            "Everything after the script name is passed to the script unchanged; a `--` before the "
            "script name ends hasten's options. Settings come from the flags, then the HASTEN_* "
            "environment variables, then the config file (see `hasten config`). Other `accelerate launch` "
            "flags are answered with what to use instead."
        ),
    )
    parser.add_argument(
        "-m", "--module", dest="module", action="store_true", help="run the script argument as a module (python -m)"
    )
    add_config_file_flag(
        parser,
        "config file to read, in hasten's format or Accelerate's (default: $HASTEN_CONFIG_FILE, else the file "
        "written by `hasten config`, else Accelerate's default config file)",
    )
    add_setting_flags(parser)
    parser.add_argument(
        "--num_cpu_threads_per_process", "--num-cpu-threads-per-process", dest="num_cpu_threads_per_process",
        type=positive_int_argument("--num_cpu_threads_per_process"), default=None, metavar="N",
        help="OMP_NUM_THREADS of each process (default: $OMP_NUM_THREADS if set, else the CPU cores "
        "divided by the processes on this machine)",
    )  # fmt: skip
    parser.add_argument(
        "--log_dir", "--log-dir", dest="log_dir", default=None, metavar="PATH",
        help="folder for the launcher's and the workers' logs (default: a temporary folder, kept and "
        "named when a worker fails)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu_ids", "--gpu-ids", dest="gpu_ids", type=_gpu_ids, default=None, metavar="IDS",
        help="GPUs of this machine to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES; 'all': every GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--multi_gpu", "--multi-gpu", dest="multi_gpu", action="store_true",
        help="accepted for Accelerate's sake: hasten picks nccl on GPUs itself; an error without a GPU",
    )  # fmt: skip
    parser.add_argument(
        "--multi_cpu", "--multi-cpu", dest="multi_cpu", action="store_true",
        help="accepted for Accelerate's sake: the same as --cpu (gloo on CPUs)",
    )  # fmt: skip
    parser.add_argument(
        "-q", "--quiet", dest="quiet", action="store_true",
        help="accepted for Accelerate's sake: a failure always shows only the relevant traceback",
    )  # fmt: skip
    # torch.distributed.run's spellings of the same settings (checked against Accelerate's when both are given).
    parser.add_argument(
        "--nnodes", dest="nnodes", type=_nnodes, default=None, metavar="N|MIN:MAX",
        help="torchrun's spelling: --num_machines N, or MIN:MAX for an elastic run (with --rdzv_backend c10d)",
    )  # fmt: skip
    parser.add_argument(
        "--nproc_per_node", "--nproc-per-node", dest="nproc_per_node", type=positive_int_argument("--nproc_per_node"),
        default=None, metavar="N",
        help="torchrun's spelling: processes on each machine (--num_processes = N x machines)",
    )  # fmt: skip
    parser.add_argument(
        "--node_rank", "--node-rank", dest="node_rank", type=_alias_type("machine_rank"), default=None, metavar="N",
        help="torchrun's spelling of --machine_rank",
    )  # fmt: skip
    parser.add_argument(
        "--master_addr", "--master-addr", dest="master_addr", type=_alias_type("main_process_ip"), default=None,
        metavar="IP", help="torchrun's spelling of --main_process_ip",
    )  # fmt: skip
    parser.add_argument(
        "--master_port", "--master-port", dest="master_port", type=_alias_type("main_process_port"), default=None,
        metavar="PORT", help="torchrun's spelling of --main_process_port",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv_endpoint", "--rdzv-endpoint", dest="rdzv_endpoint", type=_endpoint, default=None, metavar="HOST:PORT",
        help="torchrun's spelling of --main_process_ip HOST --main_process_port PORT",
    )  # fmt: skip
    parser.add_argument(
        "--same_network", "--same-network", dest="same_network", action="store_true",
        help="accepted for Accelerate's sake: machines reach machine 0 at --main_process_ip either way",
    )  # fmt: skip
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
        switch = token in no_value or _accelerate.takes_value(token) is False
        i += 1 if ("=" in token or switch) else 2
    return list(argv), []


def parse_own(parser: argparse.ArgumentParser, own: list[str]) -> argparse.Namespace:
    """parse_args with an answer for Accelerate-only flags and a "did you mean" for misspelt ones."""
    _accelerate.refuse_unsupported(parser, own)
    args, unknown = parser.parse_known_args(own)
    if unknown:
        option = next((u for u in unknown if u.startswith("-")), None)
        parser.error(_accelerate.suggest(parser, option) if option else f"unexpected argument {unknown[0]!r}")
    return args


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _default_num_processes(settings: dict[str, Any]) -> int:
    """One process per GPU on each machine; 1 per machine without GPUs or with --cpu."""
    per_machine = 1
    if not settings["cpu"]:
        per_machine = max(1, _gpu_count())
    return per_machine * settings["num_machines"]


def check_process_count(parser: argparse.ArgumentParser, settings: dict[str, Any], source: str) -> str | None:
    """Refuse an absurd process count; the warning for one above the cores/GPUs present (or None)."""
    per_machine = settings["num_processes"] // settings["num_machines"]
    if per_machine == 1:
        return None
    cores = _cpu_cores()
    gpus = 0 if settings["cpu"] else _gpu_count()
    units, what = (gpus, "GPU(s)") if gpus else (cores, "CPU core(s)")
    limit = MAX_PROCESSES_PER_CORE * max(cores, gpus)
    where = "" if source == "flag" else f" (num_processes from the {source})"
    if per_machine > MAX_PROCESSES_PER_MACHINE:
        parser.error(
            f"--num_processes {settings['num_processes']} means {per_machine} processes on each machine; "
            f"at most {MAX_PROCESSES_PER_MACHINE} per machine are allowed (one per GPU or per CPU core is usual){where}"
        )
    if per_machine > limit:
        parser.error(
            f"--num_processes {settings['num_processes']} means {per_machine} processes on this machine, "
            f"which has {cores} CPU core(s) and {gpus} GPU(s); at most {limit} are allowed "
            f"({MAX_PROCESSES_PER_CORE} per core or GPU), one per GPU or per core is usual{where}"
        )
    if per_machine > units:
        if gpus:
            return (
                f"hasten launch: warning: {per_machine} processes on {gpus} GPU(s): NCCL needs one GPU per process; "
                f"use --num_processes {gpus * settings['num_machines']}, or --cpu to train on the CPU"
            )
        return (
            f"hasten launch: warning: {per_machine} processes on {cores} CPU core(s): they share the cores and "
            f"each runs slower; --num_processes {cores * settings['num_machines']} or fewer is usual"
        )
    return None


def threads_per_process(given: int | None, per_machine: int) -> str | None:
    """The OMP_NUM_THREADS to set: the flag, else none when the environment has one, else cores ÷ processes."""
    if given is not None:
        return str(given)
    if environment.is_set(environment.OMP_NUM_THREADS):
        return None
    return str(max(1, _cpu_cores() // per_machine))


def _port_taken(port: int) -> bool:
    """Whether a TCP port of this machine has a listener (binding with SO_REUSEADDR fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def port_in_use_message(port: int, given: bool, machines: int) -> str:
    taken = f"port {port} is taken on this machine (another program is listening on it)"
    if not given:
        return f"the default {taken}; pick a free one with --main_process_port, the same on every machine"
    if machines == 1:
        return (
            f"--main_process_port: {taken}; pick another with --main_process_port, "
            "or leave the flag out to use a free one"
        )
    return f"--main_process_port: {taken}; pick another with --main_process_port, the same on every machine"


def check_port(parser: argparse.ArgumentParser, settings: dict[str, Any], resolved: dict[str, tuple[Any, str]]) -> None:
    """On the machine that hosts the rendezvous, refuse a port already taken before anything starts.

    Not with c10d and several machines (``--nnodes 2`` or ``MIN:MAX``): there every launcher may
    host torch's rendezvous store, and one that finds the port taken joins it as a client, so
    a taken port is the job's own rendezvous when a node starts (or restarts, or joins a running
    job) on the machine whose launcher hosts it, e.g. two launchers as two nodes of one machine.
    """
    port = settings["main_process_port"]
    machines = settings["num_machines"]
    if settings["machine_rank"] != 0 or (port is None and machines == 1):
        return  # other machines connect to machine 0; on one machine without a port torch picks a free one
    if settings["rdzv_backend"] != "static" and max(machines, settings.get("max_machines") or 1) > 1:
        return
    if port is None:
        port = 29500 if settings["rdzv_backend"] == "static" else 29400
    if _port_taken(port):
        parser.error(port_in_use_message(port, resolved["main_process_port"][1] != "default", machines))


def _check_target(parser: argparse.ArgumentParser, target: str, module: bool) -> None:
    if not module:
        if not os.path.exists(target):
            where = "" if os.path.isabs(target) else " (looked in the working directory)"
            parser.error(f"training script {target!r} not found{where}")
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
        parser.error(f"module {target!r} not found (run with -m, looked in the working directory and sys.path)")


def export_settings(settings: dict[str, tuple[Any, str]], cfg: ConfigFile | None) -> None:
    """Set the environment variables the script's Accelerator() reads (only settings that were given)."""
    for name, (value, source) in settings.items():
        if source != "default":
            environment.export(setting_variables(name, value))
    export_file_sources(settings)  # code overrides these silently
    use_fsdp, source = settings["use_fsdp"]
    if source != "default":
        # Accelerate's name too: transformers' from_pretrained reads ACCELERATE_USE_FSDP with
        # FSDP_CPU_RAM_EFFICIENT_LOADING (is_fsdp_enabled), and so would an ACCELERATE_USE_FSDP
        # left in the environment override --no-use_fsdp in the Accelerator.
        environment.export({environment.ACCELERATE_USE_FSDP: "true" if use_fsdp else "false"})
    export_parallelism_switch(settings)
    if cfg is not None:
        environment.export({environment.HASTEN_CONFIG_FILE: str(cfg.path)})


# The settings that the script's Accelerator() turns into a TorchDynamoPlugin or an FSDP plugin.
_PLUGIN_SETTINGS = tuple(
    n
    for n in LAUNCH_SETTINGS
    if n.startswith(("dynamo_", "fsdp_", "parallelism_config_")) or n in ("use_fsdp", "use_parallelism_config")
)


def check_plugin_settings(
    parser: argparse.ArgumentParser, settings: dict[str, Any], resolved: dict[str, tuple[Any, str]]
) -> None:
    """Build here, from the exported environment, what each worker's ``Accelerator()`` builds from
    it (the TorchDynamoPlugin and its compiler, the FSDP plugin and its check against the number
    of processes), so a value it would refuse ends the launch before any worker starts, with the
    Accelerator's own message."""
    if all(resolved[name][1] == "default" for name in _PLUGIN_SETTINGS):
        return
    from hasten.settings.parallelism import check_launch
    from hasten.settings.resolve import dynamo, fsdp_plugin_setting

    try:
        plugin = dynamo(None, None)
        if plugin.enabled:
            from hasten.training.compile import Compiler

            Compiler(plugin)
        fsdp = fsdp_plugin_setting(None)
        nd = check_launch(settings["num_processes"], bool(settings.get("cpu")))
        if fsdp is not None and nd is None:
            fsdp.check_num_processes(settings["num_processes"])
    except (TypeError, ValueError, ImportError) as err:
        parser.error(str(err))


def torch_run_args(s: dict[str, Any], target: str, module: bool, script_args: list[str]) -> list[str]:
    """The ``torch.distributed.run`` command line for settled settings ``s``."""
    machines = s["num_machines"]
    most = s.get("max_machines")
    args = [
        f"--nnodes={machines}:{most}" if most is not None and most != machines else f"--nnodes={machines}",
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
    if s.get("rdzv_conf"):
        args.append(f"--rdzv-conf={s['rdzv_conf']}")
    args += ["--module", CHILD_MODULE, *(["-m", target] if module else [target]), *script_args]
    return args


def worker_store_per_round(settings: dict[str, Any]) -> None:
    """With c10d and several machines, let each rendezvous round bootstrap its workers' store afresh.

    By default torch 2.13's c10d rendezvous gives the workers a store that the agent of group
    rank 0 starts at its first rendezvous and keeps: an agent that already has that store does
    not publish its address in a later round, so a machine joining a running job waits for it
    in vain (``wait timeout after 60000ms, keys: /torch.rendezvous.<id>.1/MASTER_ADDR``) and the
    restart fails; and a restarted group at the same size meets what the previous attempt left
    in the shared store (pytorch/pytorch#135712). With sharing off, torch has every round's rank
    0 publish a fresh address and port, and the rank-0 worker hosts that store. A value the user
    set wins. On one machine the shared store stays (state.py gives each attempt its own prefix).
    """
    if settings["rdzv_backend"] == "c10d" and max(settings["num_machines"], settings.get("max_machines") or 1) > 1:
        environment.export_default(environment.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1")


def torch_run_namespace(torch_args: list[str], log_dir: str) -> argparse.Namespace:
    """``torch.distributed.run``'s arguments for ``torch_args``, the worker's command line untouched.

    torch's parser would also read the script's own arguments: it resolves abbreviated option
    names in every token before its ``training_script_args`` (argparse REMAINDER) takes them, so
    a script argument such as ``--node A`` or ``--mo 0.9`` ends the launch with "ambiguous option:
    --node could match --node-rank, --node_rank" (pytorch/pytorch#120601). Only the launcher's
    part goes through that parser; the worker's module and what follows it are set as given.
    """
    from torch.distributed.run import get_args_parser

    end = torch_args.index(CHILD_MODULE) + 1
    args = get_args_parser().parse_args([f"--log-dir={os.path.abspath(log_dir)}", *torch_args[:end]])
    args.training_script_args = list(torch_args[end:])
    return args


def _resolve(parser: argparse.ArgumentParser, args: Any, given: dict[str, Any]) -> tuple[Any, dict, dict]:
    """The config file, every setting with its source, and the settings' values (flags, SLURM,
    environment, file, defaults: ``resolve_settings``'s order)."""
    try:
        path = find_config_file(args.config_file)
        if is_accelerate_default(path):
            print(
                f"hasten launch: reading Accelerate's config file {path} (hasten's own {default_config_path()} "
                "does not exist)",
                file=sys.stderr,
                flush=True,
            )
        cfg = load_config(path) if path is not None else None
        if cfg is not None:
            build_handlers(cfg)  # a bad handler section fails here, before any process starts
            _file_extras(args, cfg)
        pet = _torchrun_env.pet_settings(environment.current())  # torchrun's PET_* (Kubeflow Trainer)
        slurm = {**pet, **_slurm.slurm_settings(environment.current(), cpu=bool(given.get("cpu")))}
        if args.nproc_per_node is not None:
            slurm.pop("num_processes", None)
        resolved = resolve_settings(given, cfg, detected=slurm)
    except (OSError, TypeError, ValueError, ImportError) as err:
        parser.error(str(err))
    settings = {name: value for name, (value, _) in resolved.items()}
    if args.nproc_per_node is not None:
        total = args.nproc_per_node * settings["num_machines"]
        if given.get("num_processes") is not None and given["num_processes"] != total:
            parser.error(
                f"--nproc_per_node {args.nproc_per_node} x {settings['num_machines']} machine(s) = {total} and "
                f"--num_processes {given['num_processes']} disagree: give one of them"
            )
        settings["num_processes"] = total
        resolved["num_processes"] = (total, "flag")
    for warning in _torchrun_env.disagreements(pet, resolved):
        print(redact(warning), file=sys.stderr, flush=True)
    return cfg, resolved, settings


def _file_extras(args: Any, cfg: ConfigFile) -> None:
    """What an Accelerate config file says besides the launch settings: its notes (printed), its
    gpu_ids (CUDA_VISIBLE_DEVICES, unless --gpu_ids or the variable is set) and its debug
    (collectives check their shapes: HASTEN_DEBUG_MODE, unless set)."""
    for note in cfg.notes:
        print(f"hasten launch: {redact(note)}", file=sys.stderr, flush=True)
    if cfg.gpu_ids is not None and args.gpu_ids is None:
        environment.export_default(environment.CUDA_VISIBLE_DEVICES, cfg.gpu_ids)
    if cfg.debug:
        environment.export_default(environment.HASTEN_DEBUG_MODE, "1")


def _fsdp1(parser: argparse.ArgumentParser, resolved: dict[str, tuple[Any, str]], settings: dict[str, Any]) -> None:
    """FSDP1's settings (flags, FSDP_* variables, either config format) run as FSDP2's, said in one line."""
    try:
        notes = apply_fsdp1(resolved, settings["num_processes"])
    except SettingsError as err:
        parser.error(str(err))
    settings.update({name: value for name, (value, _) in resolved.items()})
    for note in notes:
        print(f"hasten launch: {redact(note)}", file=sys.stderr, flush=True)


def launch_command(argv: Sequence[str]) -> int:
    parser = build_parser()
    own, rest = split_argv(parser, argv)
    args = parse_own(parser, own)
    if not rest:
        parser.error("the training script is missing: " + USAGE)
    target, script_args = rest[0], rest[1:]
    if args.gpu_ids is not None and args.gpu_ids.lower() != "all":
        environment.export({environment.CUDA_VISIBLE_DEVICES: args.gpu_ids})  # before torch counts the GPUs
    given = given_settings(args)
    torchrun_spellings(parser, args, given)
    if args.multi_cpu:
        if args.multi_gpu:
            parser.error("--multi_cpu and --multi_gpu contradict each other: give one (or neither: hasten chooses)")
        given["cpu"] = True
    cfg, resolved, settings = _resolve(parser, args, given)
    warning = None
    if settings["num_processes"] is not None:  # a given count is checked before the script (no torch needed for it)
        warning = check_process_count(parser, settings, resolved["num_processes"][1])
    _check_target(parser, target, args.module)
    if args.multi_gpu:
        if settings["cpu"]:
            parser.error("--multi_gpu asks for GPUs but --cpu (or cpu: true in the config) asks for the CPU: drop one")
        if _gpu_count() == 0:
            visible = environment.get(environment.CUDA_VISIBLE_DEVICES)
            parser.error(
                "--multi_gpu: no CUDA GPU is visible on this machine"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + "; drop --multi_gpu to train on the CPU (hasten chooses gloo there by itself)"
            )
    if settings["num_processes"] is None:
        settings["num_processes"] = _default_num_processes(settings)
        resolved["num_processes"] = (settings["num_processes"], "default")
        if settings["num_processes"] % settings["num_machines"]:  # pragma: no cover - defaults divide
            parser.error("num_processes must be a multiple of num_machines")
        warning = check_process_count(parser, settings, "default")
    _fsdp1(parser, resolved, settings)
    export_settings(resolved, cfg)
    check_plugin_settings(parser, settings, resolved)
    worker_store_per_round(settings)
    per_machine = settings["num_processes"] // settings["num_machines"]
    threads = threads_per_process(args.num_cpu_threads_per_process, per_machine)
    if threads is not None:  # one process too: torch's own default ignores the cores this process may use
        environment.export({environment.OMP_NUM_THREADS: threads})  # quietly (torchrun would print a banner)
    # Kineto prints "USDT ... profiler_start/stop" on stderr, through the progress bar: off unless asked for.
    environment.export_default(environment.KINETO_LOG_LEVEL, "6")
    if warning:
        print(redact(warning), file=sys.stderr, flush=True)

    elastic = (settings["max_machines"] or 1) > 1
    if per_machine == 1 and settings["num_machines"] == 1 and settings["max_restarts"] == 0 and not elastic:
        # One process: be `python script.py` (same process, signals and exit status).
        sys.stdout.flush()
        sys.stderr.flush()
        # through a runner that imports hasten first (its console filters), then runs the script as python would
        runner = ["-m", "hasten.compat.as_accelerate" if settings["as_accelerate"] else "hasten._main"]
        command = [sys.executable, *runner, *(["-m", target] if args.module else [target]), *script_args]
        os.execv(sys.executable, command)
    check_port(parser, settings, resolved)
    return run_workers(
        torch_run_args(settings, target, args.module, script_args),
        log_dir=args.log_dir,
        port=(settings["main_process_port"], resolved["main_process_port"][1] != "default", settings["num_machines"]),
    )


class _LogToFile:
    """torch.distributed's own log lines (the agent's "Sending process ... SIGTERM", "failed (exitcode...)")
    go to ``launcher.log`` in the log folder instead of the console, while the agent runs."""

    def __init__(self, path: str) -> None:
        import logging

        self.logger = logging.getLogger("torch.distributed")
        self.handler = logging.FileHandler(path, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = list(self.logger.handlers)
        for handler in self.saved:
            self.logger.removeHandler(handler)
        self.logger.addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()
        for handler in self.saved:
            self.logger.addHandler(handler)


def run_workers(
    torch_args: list[str], log_dir: str | None = None, port: tuple[int | None, bool, int] = (None, False, 1)
) -> int:
    """Run torch's elastic agent here; turn a worker failure or a signal into an exit status.

    The agent's error files and log lines go to ``log_dir`` (a temporary folder unless given);
    a temporary folder is removed after a run that succeeded and kept (and named) after a failure,
    or after a Ctrl-C that ranks stuck in a collective outlived (``_CtrlC``). A collective that
    timed out, or a stop while a rank was in a collective, is told first: which rank did not
    arrive and where each rank was (``hang_report``, ``stopped_report``).
    """
    import threading

    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    if threading.current_thread() is threading.main_thread():
        # The workers die with this process (see hasten.cli._child). The kernel's signal follows
        # the thread that started a worker: torch's agent starts them from this one, which lives
        # as long as the launcher only when it is the main thread.
        environment.export({environment.HASTEN_LAUNCHER_PID: str(os.getpid())})
    temporary = log_dir is None
    shown = log_dir
    if log_dir is None:
        log_dir = shown = tempfile.mkdtemp(prefix="hasten-launch-")
    else:
        os.makedirs(log_dir, exist_ok=True)
    keep = not temporary
    try:
        namespace = torch_run_namespace(torch_args, log_dir)
        ctrl_c, continued = _CtrlC(namespace), ContinueStopped()
        with _LogToFile(os.path.join(log_dir, "launcher.log")), ctrl_c, continued:
            run(namespace)
    except ChildFailedError as err:
        message, status = describe_failure(err, log_dir, shown, continued.frozen)
        keep = keep or bool(message)
        if message:
            print(redact(message), file=sys.stderr, flush=True)
        return status
    except DistNetworkError as err:
        if "EADDRINUSE" not in str(err) or port[0] is None:
            raise
        print(f"hasten launch: error: {port_in_use_message(port[0], port[1], port[2])}", file=sys.stderr, flush=True)
        return 2
    except RendezvousError as err:
        keep = True
        print(rendezvous_failure_message(err, shown), file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        stuck = bool(ctrl_c.killed)  # a rank still running after Ctrl-C: its stack stays in the logs
        report = stopped_report(log_dir, shown if keep or stuck else None, ctrl_c.killed)
        keep = keep or (stuck and bool(report))
        name = signal.Signals(err.sigval).name
        report.append(f"hasten launch: stopped by {name}; all workers were stopped")
        print("\n".join(report), file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the workers started (e.g. waiting for other machines)
        print("hasten launch: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        if not keep:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0
