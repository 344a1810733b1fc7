"""Run by 2 processes: the multi-process checks of Accelerate's API beyond the core
(trackers, sync_each_batch, split batches, ...), one JSON file of results per rank (OUT_DIR/rank{RANK}.json).

usage: parity_checks.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

from hasten import Accelerator, DataLoaderConfiguration, GeneralTracker, GradientAccumulationPlugin

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

# ---------------------------------------------------------------------- GradientAccumulationPlugin(sync_each_batch)


def first_micro_step_grads(sync_each_batch: bool) -> dict:
    """Gradients after one (non-syncing) micro-step with this rank's own data, as every rank has them."""
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(3, 1))
    x = torch.full((4, 3), float(accelerator.process_index + 1))
    with accelerator.accumulate(model):
        accelerator.backward(model(x).sum())
    grads = accelerator.gather(model.module.weight.grad.detach().clone()[None])
    return {"sync_gradients": accelerator.sync_gradients, "ranks_agree": bool(torch.equal(grads[0], grads[1]))}


results["sync_each_batch"] = {"on": first_micro_step_grads(True), "off": first_micro_step_grads(False)}

# ---------------------------------------------------------------------- DataLoaderConfiguration
split = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False))
loader = split.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=4))
results["split"] = [b.tolist() for (b,) in loader]

# ---------------------------------------------------------------------- end: trackers finish, the group goes
rank = acc.process_index
acc.end_training()
results["trackers"]["everywhere_calls"] = everywhere.calls
results["trackers"]["main_only_after_finish"] = main_only.calls
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
