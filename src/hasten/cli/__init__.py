"""The ``hasten`` command: ``launch``, ``demo``, ``config``, ``env``, ``profile-report``, ``merge-weights``,
``estimate-memory`` and ``lighthouse``.

Built on argparse. Nothing here imports torch at module level: ``hasten --help``,
``hasten launch --help`` and ``hasten config`` start in a fraction of a second; ``hasten
launch`` imports ``torch.distributed.run`` when it starts the workers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from hasten.cli._flags import Parser
    from hasten.cli.config_cmd import add_config_parser

    parser = Parser(
        prog="hasten",
        description="Run one PyTorch training loop on one CPU, one GPU or many processes and machines.",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="{launch,demo,config,env,profile-report,merge-weights,estimate-memory,lighthouse}"
    )
    commands.add_parser(
        "launch",
        help="start a training script on N processes with torch.distributed.run (hasten launch --help)",
        add_help=False,
    )
    add_config_parser(commands)
    commands.add_parser(
        "demo",
        help="the main job: train a CNN on digits with 2 processes (hasten demo --help)",
        add_help=False,
    )
    commands.add_parser(
        "env",
        help="print what a bug report needs: versions, devices, the config file in use",
        description=(
            "Print what a bug report needs, as a Markdown list to paste into an issue: the versions of hasten, "
            "Python, torch and the optional packages, whether CUDA, NCCL and gloo are available, the OS, the CPU "
            "count, the GPUs, the HASTEN_* variables, and the config file in use with its content."
        ),
    )
    from hasten import report  # torch-free

    report.add_arguments(
        commands.add_parser(
            "profile-report",
            help="read accelerator.profile() traces: top operators, step breakdown, merged trace, PNG chart",
            description=report.DESCRIPTION,
        )
    )
    commands.add_parser(  # parses its own arguments (cli/merge_weights.py), as launch and demo do
        "merge-weights",
        help="join a save_state checkpoint's model weights (sharded by FSDP, or full) into one file "
        "(hasten merge-weights --help)",
        add_help=False,
    )
    commands.add_parser(  # parses its own arguments (cli/estimate_memory.py)
        "estimate-memory",
        help="memory a model needs to load and to train with Adam, per dtype, counted on the meta device "
        "(hasten estimate-memory --help)",
        add_help=False,
    )
    commands.add_parser(  # parses its own arguments (cli/lighthouse.py)
        "lighthouse",
        help="torchft's lighthouse for training through failures (FaultToleranceKwargs; hasten lighthouse --help)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hasten`` command; returns the exit status.

    Output into a pipe that closes early (``hasten ... | head``) ends the command quietly with
    status 141, as a program stopped by SIGPIPE, whatever printed it (a command, or argparse's
    ``--help``, which exits through SystemExit): no traceback, usage or "Broken pipe" message, and
    nothing from the interpreter's last flush. A failure keeps its own status."""
    try:
        status = _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except SystemExit as stop:  # argparse: --help (status 0) or a usage error (2)
        closed = not _flushed() or _reader_gone()
        if closed and not stop.code:
            return 141
        raise
    return status if _flushed() or status else 141


def _flushed() -> bool:
    """Flush stdout; False, with stdout then pointed at /dev/null, when its reader is gone."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return False
    return True


def _reader_gone() -> bool:
    """Whether stdout is a pipe its reader closed (POLLERR), with stdout then pointed at /dev/null.
    Needed after argparse's ``--help``: argparse drops the text it could not write, error and all."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # pragma: no cover - not a file, or no poll() (Windows)
        return False
    if gone:
        _stdout_to_devnull()
    return gone


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at /dev/null, so the interpreter's final flush of what is still
    buffered does not fail again ("Exception ignored ... BrokenPipeError", status 120)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout replaced by a non-file object
        pass


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "demo":
        from hasten.cli.demo import demo_command

        return demo_command(argv[1:])
    if argv and argv[0] == "merge-weights":
        from hasten.cli.merge_weights import merge_weights_command

        return merge_weights_command(argv[1:])
    if argv and argv[0] == "lighthouse":
        from hasten.cli.lighthouse import lighthouse_command

        return lighthouse_command(argv[1:])
    if argv and argv[0] == "estimate-memory":
        from hasten.cli.estimate_memory import estimate_memory_command

        return estimate_memory_command(argv[1:])
    if argv and argv[0] == "launch":
        # `launch` parses its own arguments: everything after the script goes to the script.
        from hasten.cli.launch import launch_command

        return launch_command(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "config":
        from hasten.cli.config_cmd import config_command

        return config_command(args)
    if args.command == "env":
        from hasten.cli.env import env_command

        return env_command()
    if args.command == "profile-report":
        from hasten import report

        return report.run(args)
    parser.print_help(sys.stderr)
    return 2
