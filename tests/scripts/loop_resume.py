"""Exact resume, run as plain `python` (1 process) or with torch.distributed.run (2 processes).

    loop_resume.py OUT first SAVE_EPOCH SAVE_BATCH
        straight: 3 epochs, no checkpoint
        continued: 3 epochs, save_state to OUT/ckpt_continued at (SAVE_EPOCH, SAVE_BATCH), go on
        stopped: train to (SAVE_EPOCH, SAVE_BATCH), save_state to OUT/ckpt, stop
    loop_resume.py OUT resume
        resumed: a fresh process loads OUT/ckpt and finishes the 3 epochs

Each process writes OUT/PHASE_rank{r}.json (records per micro-step) and the final weights
OUT/PHASE_TAG_rank{r}.pt for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from loop_common import make_accelerator, train, weights


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    results = {}
    if phase == "first":
        save_at = (int(sys.argv[3]), int(sys.argv[4]))
        runs = {
            "straight": {},
            "continued": {"save_at": save_at, "save_dir": os.path.join(out, "ckpt_continued")},
            "stopped": {"save_at": save_at, "save_dir": os.path.join(out, "ckpt"), "stop_after_save": True},
        }
    else:
        runs = {"resumed": {"resume_dir": os.path.join(out, "ckpt")}}
    rank = 0
    for tag, kwargs in runs.items():
        accelerator = make_accelerator()
        rank = accelerator.process_index
        records, model, loaded = train(accelerator, **kwargs)
        torch.save(weights(accelerator, model), os.path.join(out, f"{tag}_rank{rank}.pt"))
        results[tag] = {"records": records, "loaded": loaded, "world_size": accelerator.num_processes}
    with open(os.path.join(out, f"{phase}_rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
