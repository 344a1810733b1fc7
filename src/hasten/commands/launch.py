"""``accelerate.commands.launch``'s ``launch_command_parser`` and ``launch_command``: ``hasten
launch`` behind Accelerate's two-step interface (parse, then launch), which TRL's CLI calls::

    args = launch_command_parser().parse_args(["--num_processes", "2", "train.py", "--lr", "1e-4"])
    launch_command(args)

The flags are ``hasten launch``'s (Accelerate's spellings, checked by the same rules). Under
``install_as_accelerate()`` the workers run with it too (``--as_accelerate``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["launch_command", "launch_command_parser"]


class _LaunchParser(argparse.ArgumentParser):
    """``hasten launch``'s parser with Accelerate's positionals (``training_script``,
    ``training_script_args``); the namespace it gives keeps the command line for
    :func:`launch_command`."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        from hasten.cli import launch as cli

        argv = list(sys.argv[1:] if args is None else args)
        own, rest = cli.split_argv(self, argv)
        parsed = cli.parse_own(self, own)  # refused or misspelt flags: the parser's error, as hasten launch's
        if not rest:
            self.error("the training script is missing: " + cli.USAGE)
        parsed.training_script, parsed.training_script_args = rest[0], rest[1:]
        parsed.hasten_argv = argv
        return parsed


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``hasten launch``'s command line (``subparsers`` is accepted and not used:
    hasten has no ``accelerate`` command of its own)."""
    from hasten.cli import launch as cli

    base = cli.build_parser()
    parser = _LaunchParser(
        prog=base.prog, usage=base.usage, description=base.description, allow_abbrev=False, add_help=False
    )
    parser._add_container_actions(base)
    return parser


def launch_command(args: argparse.Namespace) -> None:
    """Launch what ``launch_command_parser().parse_args(...)`` parsed; a failed run exits with
    its status (as Accelerate's does)."""
    from hasten.cli import launch as cli
    from hasten.compat.as_accelerate import is_installed

    argv = getattr(args, "hasten_argv", None)
    if argv is None:
        raise TypeError(
            "launch_command(args): args must come from hasten's launch_command_parser().parse_args(...), "
            f"got {type(args).__name__} without the command line"
        )
    if is_installed() and "--as_accelerate" not in argv:
        argv = ["--as_accelerate", *argv]
    status = cli.launch_command(argv)
    if status:
        sys.exit(status)
