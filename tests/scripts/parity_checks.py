"""Run by 2 processes: the multi-process checks of Accelerate's API beyond the core
(trackers, sync_each_batch, split batches, trigger, on_process, join_uneven_inputs), one JSON
file of results per rank (OUT_DIR/rank{RANK}.json).

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

# ---------------------------------------------------------------------- trigger, on_process, join, get_state_dict
me = acc.process_index
results["trigger"] = [acc.check_trigger()]  # nobody raised it
if me == 1:
    acc.set_trigger()
results["trigger"] += [acc.check_trigger(), acc.check_trigger()]  # seen everywhere, then lowered


@acc.on_process(process_index=1)
def on_one():
    return f"ran on {me}"


results["on_process"] = [
    on_one(),
    acc.on_process(lambda: me, process_index=0)(),
    acc.on_last_process(lambda: me)(),
    acc.on_local_process(lambda: me, local_process_index=1)(),
    acc.on_main_process(lambda: me)(),
]

# Uneven batches: 10 samples in batches of 4 give rank 0 two batches and rank 1 one; without Join
# rank 0's second backward would wait for rank 1 forever.
joiner = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
model, optimizer, loader = joiner.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
batches = 0
with joiner.join_uneven_inputs([model], even_batches=False):
    for x, y in loader:
        joiner.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        batches += 1
weights = joiner.gather(joiner.get_state_dict(model)["weight"].detach().clone()[None])
results["join"] = {
    "batches": batches,
    "weights_agree": bool(torch.equal(weights[0], weights[1])),
    "even_batches_after": loader.shard_sampler.even_batches,
    "batches_after": len(loader),
    "wrapped_keys": sorted(joiner.get_state_dict(model, unwrap=False)),
    "keys": sorted(joiner.get_state_dict(model)),
}
results["evaluation_mode"] = [
    type(joiner.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)).__name__,
    type(joiner.prepare_model(torch.nn.Linear(2, 2))).__name__,
]
results["gather_for_metrics"] = joiner.gather_for_metrics(input_data=torch.tensor([me])).tolist()

# ---------------------------------------------------------------------- hasten.logging
# one line per record, in rank order
import logging  # noqa: E402

from hasten.logging import get_logger  # noqa: E402

log_file = os.path.join(out_dir, "log.txt")
handler = logging.FileHandler(log_file)
handler.setFormatter(logging.Formatter("%(message)s"))
mp_logger = get_logger("parity", log_level="INFO")
mp_logger.logger.addHandler(handler)
mp_logger.info("main only from %d", me)
mp_logger.info("everyone: %d", me, main_process_only=False)
joiner.wait_for_everyone()
for _ in range(3):  # in order, whatever the timing
    mp_logger.info("in order: %d", me, in_order=True)
handler.close()
joiner.wait_for_everyone()

# ---------------------------------------------------------------------- end: trackers finish, the group goes
rank = acc.process_index
acc.end_training()
results["trackers"]["everywhere_calls"] = everywhere.calls
results["trackers"]["main_only_after_finish"] = main_only.calls
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
