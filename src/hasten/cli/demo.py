"""``hasten demo``: the main job — examples/train_digits.py on 2 processes (this CPU, gloo).

The demo's own options and the training script's are parsed here, in the launching process,
before any worker starts: ``hasten demo --help`` lists both, a misspelt flag is an error with
a suggestion, and ``--resume`` is checked against the run folder's newest checkpoint (a
refusal is printed once, naming the flag that fixes it). The arguments then go to the script
unchanged (``hasten demo --epochs 3 --resume``), with ``--project_dir`` added when not given.

Run folders: each configuration has a folder, ``runs/digits/<precision>-<N>proc``, and each run
without ``--resume`` a new one inside it, ``run-1``, ``run-2``, ... (checkpoint numbers start at 0
again and TensorBoard shows each run as its own curve); ``--resume`` continues the newest run
that holds a checkpoint. An explicit ``--project_dir`` is used as given.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from hasten.cli._flags import Parser

DEMO_SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"
MAX_DEMO_PROCESSES = 64
# Each run of the demo gets its own folder inside its configuration's (runs/digits/bf16-2proc/run-3).
RUN_NAME = re.compile(r"run-(\d+)")
CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)")


def _load_script() -> ModuleType:
    """examples/train_digits.py as a module (its argument parser and resume check; nothing runs)."""
    spec = importlib.util.spec_from_file_location("hasten_demo_train_digits", DEMO_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(configuration: str) -> list[int]:
    """The numbers of the ``run-<k>`` folders in a configuration's folder, newest first."""
    names = os.listdir(configuration) if os.path.isdir(configuration) else []
    return sorted((int(m.group(1)) for name in names if (m := RUN_NAME.fullmatch(name))), reverse=True)


def _has_checkpoint(folder: str) -> bool:
    root = os.path.join(folder, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return any(
        CHECKPOINT_NAME.fullmatch(name) and os.path.isfile(os.path.join(root, name, "hasten_checkpoint.json"))
        for name in names
    )


def newest_run(configuration: str) -> str | None:
    """The run ``--resume`` continues: the newest ``run-<k>`` folder holding a complete checkpoint,
    else the configuration's folder itself when a run launched without the demo saved there;
    None when there is no checkpoint at all."""
    folders = [os.path.join(configuration, f"run-{k}") for k in _runs(configuration)] + [configuration]
    return next((folder for folder in folders if _has_checkpoint(folder)), None)


def new_run(configuration: str) -> str:
    """Make the next ``run-<k>`` folder (one more than the newest) and return it; ``mkdir`` claims
    the number, so two demos started together get two folders."""
    os.makedirs(configuration, exist_ok=True)
    number = (_runs(configuration) or [0])[0] + 1
    while True:
        folder = os.path.join(configuration, f"run-{number}")
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            number += 1


def _processes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num_processes must be an integer >= 1, got {text!r}") from None
    if not 1 <= value <= MAX_DEMO_PROCESSES:
        raise argparse.ArgumentTypeError(f"--num_processes must be in 1 .. {MAX_DEMO_PROCESSES}, got {value}")
    return value


def _own_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = Parser(add_help=add_help, allow_abbrev=False)
    parser.add_argument(
        "--num_processes", "--num-processes", dest="num_processes", type=_processes, default=2,
        help="processes to launch (default 2)",
    )  # fmt: skip
    return parser


def build_parser(script: ModuleType) -> argparse.ArgumentParser:
    parser = Parser(
        prog="hasten demo",
        parents=[_own_parser(add_help=False), script.build_parser(add_help=False)],
        allow_abbrev=False,
        description="Train a small CNN on scikit-learn's digits with 2 processes: DDP, bf16, gradient "
        "accumulation, checkpoints and --resume, profiling, TensorBoard logs, a curves PNG "
        "(examples/train_digits.py, started by hasten launch).",
    )
    parser.add_argument("--script-help", action="help", help="the same as --help")
    return parser


def demo_command(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not DEMO_SCRIPT.is_file():
        print(
            "hasten demo: examples/train_digits.py is not there; the demo runs from a source checkout of hasten "
            "(git clone, then `make demo`)",
            file=sys.stderr,
        )
        return 2
    from hasten.cli._accelerate import suggest

    script = _load_script()
    parser = build_parser(script)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        option = next((u for u in unknown if u.startswith("-")), None)
        parser.error(suggest(parser, option) if option else f"unexpected argument {unknown[0]!r}")
    script.check_args(parser, args)
    configuration = None
    if args.project_dir is None:
        configuration = script.default_project_dir(args.mixed_precision, args.num_processes)
        if args.resume:
            args.project_dir = newest_run(configuration)
            if args.project_dir is None:
                parser.error(
                    f"--resume: there is no checkpoint in {configuration} yet; run once without --resume first"
                )
    if args.resume:
        refusal = script.resume_refusal(args.project_dir, args.mixed_precision, args.num_processes)
        if refusal:
            parser.error(refusal)
    missing = [name for name in ("sklearn", "tqdm") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"hasten demo: the demo needs {', '.join(missing)}: pip install 'hasten[demo]'", file=sys.stderr)
        return 2
    _, script_args = _own_parser(add_help=False).parse_known_args(argv)
    if configuration is not None:
        if args.project_dir is None:
            try:
                args.project_dir = new_run(configuration)
            except OSError as e:
                print(f"hasten demo: cannot make a run folder in {configuration}: {e}", file=sys.stderr)
                return 2
        script_args = [*script_args, "--project_dir", args.project_dir]
    from hasten.cli.launch import launch_command

    return launch_command(["--num_processes", str(args.num_processes), str(DEMO_SCRIPT), *script_args])
