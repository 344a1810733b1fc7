"""``hasten merge-weights CHECKPOINT OUTPUT``: one model file from a ``save_state`` checkpoint.

Accelerate's command name. Joins the shards of a sharded (FSDP, "dcp" layout) checkpoint in
this one process, without a process group, into ``OUTPUT/model.safetensors``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hasten.cli._flags import Parser

DESCRIPTION = (
    "Join the model weights of a checkpoint written by accelerator.save_state() (sharded by FSDP, or full) "
    "into one file, OUTPUT/model.safetensors, with the model's own keys. Runs in this one process."
)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hasten merge-weights", description=DESCRIPTION)
    parser.add_argument("checkpoint_directory", help="a checkpoint folder written by save_state")
    parser.add_argument("output_path", help="the folder to write model.safetensors (or pytorch_model.bin) into")
    parser.add_argument("--model_index", type=int, default=0, help="which prepared model (default: 0, the first)")
    parser.add_argument(
        "--unsafe_serialization",
        action="store_true",
        help="write pytorch_model.bin (torch.save) instead of safetensors",
    )
    return parser


def merge_weights_command(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    from hasten.checkpoint.merge import merge_weights

    try:
        path = merge_weights(
            args.checkpoint_directory,
            args.output_path,
            model_index=args.model_index,
            safe_serialization=not args.unsafe_serialization,
        )
    except (ValueError, TypeError, OSError, ImportError) as e:
        message = str(e) if str(e).startswith("merge-weights") else f"merge-weights: {e}"
        print(f"hasten {message}", file=sys.stderr)
        return 1
    print(path)
    return 0
