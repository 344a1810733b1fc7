"""Run by 2 processes: the multi-process checks of Accelerate's API beyond the core
(trackers, ...), one JSON file of results per rank (OUT_DIR/rank{RANK}.json).

usage: parity_checks.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch  # noqa: F401

from hasten import Accelerator, GeneralTracker

out_dir = sys.argv[1]
results: dict = {}


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, name: str, main_process_only: bool):
        super().__init__()
        self.name = name
        self.main_process_only = main_process_only
        self.calls: list[str] = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append("start")

    def store_init_configuration(self, values):
        self.calls.append("config")

    def log(self, values, step=None, **kwargs):
        self.calls.append(f"log {values['rank']}")

    def finish(self):
        self.calls.append("finish")


# ---------------------------------------------------------------------- trackers
main_only, everywhere = Recorder("main_only", True), Recorder("everywhere", False)
acc = Accelerator(log_with=["tensorboard", main_only, everywhere], project_dir=os.path.join(out_dir, "logs"))
acc.init_trackers("exp", config={"lr": 0.1})
acc.log({"rank": acc.process_index}, step=acc.process_index)
results["trackers"] = {
    "active": [t.name for t in acc.trackers],
    "tensorboard_type": type(acc.get_tracker("tensorboard")).__name__,
    "main_only_calls": list(main_only.calls),
}

# ---------------------------------------------------------------------- end: trackers finish, the group goes
rank = acc.process_index
acc.end_training()
results["trackers"]["everywhere_calls"] = everywhere.calls
results["trackers"]["main_only_after_finish"] = main_only.calls
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
