"""``hasten demo``: the main job — examples/train_digits.py on 2 processes (this CPU, gloo).

Any other argument goes to the training script (``hasten demo --epochs 3 --resume``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEMO_SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"


def demo_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hasten demo",
        description="Train a small CNN on scikit-learn's digits with 2 processes: DDP, bf16, "
        "accumulation, checkpoints, profiling. Other arguments go to examples/train_digits.py "
        "(see `hasten demo --script-help`).",
    )
    parser.add_argument("--num_processes", type=int, default=2, help="processes to launch (default 2)")
    parser.add_argument("--script-help", action="store_true", help="show the training script's own options")
    args, script_args = parser.parse_known_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num_processes must be >= 1, got {args.num_processes}")
    if not DEMO_SCRIPT.is_file():
        print(
            f"hasten demo: {DEMO_SCRIPT} is not there; the demo runs from a source checkout of hasten "
            "(git clone, then `make demo`)",
            file=sys.stderr,
        )
        return 2
    if args.script_help:
        script_args = ["--help"]
    from .launch import launch_command

    return launch_command(["--num_processes", str(args.num_processes), str(DEMO_SCRIPT), *script_args])
