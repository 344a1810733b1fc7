"""Run by 2 processes under ``hasten launch``: a known hasten error, not caught, for the
launcher's summary (issue 48 item 7b).

usage: rel5_damaged.py OUT_DIR CASE

CASE "metadata": saves an FSDP2 ("dcp") checkpoint, rank 0 overwrites its model's ``.metadata``
with garbage (its manifest checksum recomputed), every rank loads it (DamagedCheckpoint).
CASE "config": every rank builds an Accelerator with a bad value (hasten's ValueError).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import make_model  # noqa: E402
from trust_common import damage_metadata  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402


def load_damaged(out: str) -> None:
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = acc.prepare(make_model())
    acc.backward(model(torch.randn(4, 8)).sum())
    ck = acc.save_state(os.path.join(out, "ck"))
    if acc.is_main_process:
        damage_metadata(ck, how="garbage", recompute=True)
    acc.wait_for_everyone()
    acc.load_state(ck)  # not caught


def bad_config() -> None:
    Accelerator(gradient_accumulation_steps=0)  # not caught


if __name__ == "__main__":
    if sys.argv[2] == "metadata":
        load_damaged(sys.argv[1])
    else:
        bad_config()
