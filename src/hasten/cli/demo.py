"""``hasten demo``: the main job — examples/train_digits.py on 2 processes (this CPU, gloo).

The demo's own options and the training script's are parsed here, in the launching process,
before any worker starts: ``hasten demo --help`` lists both, a misspelt flag is an error with
a suggestion, and ``--resume`` is checked against the run folder's newest checkpoint (a
refusal is printed once, naming the flag that fixes it). The arguments then go to the script
unchanged (``hasten demo --epochs 3 --resume``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

DEMO_SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"
MAX_DEMO_PROCESSES = 64


def _load_script() -> ModuleType:
    """examples/train_digits.py as a module (its argument parser and resume check; nothing runs)."""
    spec = importlib.util.spec_from_file_location("hasten_demo_train_digits", DEMO_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _processes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num_processes must be an integer >= 1, got {text!r}") from None
    if not 1 <= value <= MAX_DEMO_PROCESSES:
        raise argparse.ArgumentTypeError(f"--num_processes must be in 1 .. {MAX_DEMO_PROCESSES}, got {value}")
    return value


def _own_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=add_help, allow_abbrev=False)
    parser.add_argument(
        "--num_processes", "--num-processes", dest="num_processes", type=_processes, default=2,
        help="processes to launch (default 2)",
    )  # fmt: skip
    return parser


def build_parser(script: ModuleType) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    if args.project_dir is None:
        args.project_dir = script.default_project_dir(args.mixed_precision, args.num_processes)
    if args.resume:
        refusal = script.resume_refusal(args.project_dir, args.mixed_precision, args.num_processes)
        if refusal:
            parser.error(refusal)
    missing = [name for name in ("sklearn", "tqdm") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"hasten demo: the demo needs {', '.join(missing)}: pip install 'hasten[demo]'", file=sys.stderr)
        return 2
    _, script_args = _own_parser(add_help=False).parse_known_args(argv)
    from hasten.cli.launch import launch_command

    return launch_command(["--num_processes", str(args.num_processes), str(DEMO_SCRIPT), *script_args])
