"""The launch-setting flags shared by ``hasten launch``, ``hasten config`` and ``config show``.

Each flag is spelled with underscores (as in Accelerate) and with dashes, and is checked by
the same rule as the config file key of the same name (``hasten.settings.launch_settings.LAUNCH_SETTINGS``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from hasten.settings.choices import DYNAMO_MODES, MIXED_PRECISION_CHOICES, RDZV_BACKENDS
from hasten.settings.launch_settings import LAUNCH_SETTINGS, parse_setting_text
from hasten.settings.locations import redact

_CHOICES = {"mixed_precision": MIXED_PRECISION_CHOICES, "rdzv_backend": RDZV_BACKENDS, "dynamo_mode": DYNAMO_MODES}
_METAVARS = {
    "main_process_ip": "IP",
    "main_process_port": "PORT",
    "monitor_interval": "SECONDS",
    "rdzv_conf": "K=V,...",
    "ft_lighthouse": "URL",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors hide the password of a ``scheme://user:password@`` URL they
    quote (a flag's or a config file's value), as every message of hasten does. Every ``hasten``
    command's parser is one (subcommands' parsers are made of their parent's class)."""

    def error(self, message: str) -> NoReturn:
        super().error(redact(message))


def flag_names(name: str) -> list[str]:
    dashed = name.replace("_", "-")
    return [f"--{name}"] if dashed == name else [f"--{name}", f"--{dashed}"]


def _type(name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_setting_text(name, text)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = name
    return parse


def add_setting_flags(parser: argparse.ArgumentParser | Any) -> None:
    """One flag per launch setting; every default is None (meaning: not given)."""
    for name, setting in LAUNCH_SETTINGS.items():
        if setting.kind is bool:
            parser.add_argument(
                *flag_names(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=setting.help
            )
        elif name in _CHOICES:
            parser.add_argument(
                *flag_names(name),
                dest=name,
                type=str.lower,
                choices=_CHOICES[name],
                default=None,
                help=f"{setting.help} (default: {setting.default})",
            )
        else:
            default = f" (default: {setting.default})" if setting.default is not None else ""
            parser.add_argument(
                *flag_names(name),
                dest=name,
                type=_type(name),
                default=None,
                metavar=_METAVARS.get(name, "N"),
                help=setting.help + default,
            )


def add_config_file_flag(parser: argparse.ArgumentParser | Any, help: str) -> None:
    parser.add_argument("--config_file", "--config-file", dest="config_file", default=None, metavar="PATH", help=help)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The launch settings given as flags (None: not given)."""
    return {name: getattr(args, name) for name in LAUNCH_SETTINGS}
