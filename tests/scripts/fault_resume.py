"""A training run that checkpoints every SAVE_EVERY steps and, on start, resumes from the newest checkpoint.

usage: fault_resume.py OUT (straight | crash_once | kill_in_save)

* straight: no fault.
* crash_once: rank 1 raises right after optimizer step CRASH_AT, once (a marker file in OUT
  remembers); under `hasten launch --max_restarts 1` the workers restart and resume.
* kill_in_save: rank 0 is SIGKILLed halfway through writing a file of the checkpoint at step
  KILL_AT, once; after the restart the script tries to load the partial checkpoint (it must
  be refused, changing nothing), then resumes from the newest complete one.

Each attempt appends what it saw to OUT/attempts_rank{r}.jsonl; the weights after each save
go to OUT/saved_step{N}_rank{r}.pt and the final ones to OUT/final_rank{r}.pt.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed

EPOCHS = 3  # 64 samples, batch 4, 2 processes: 8 steps per epoch, 24 in all
SAVE_EVERY = 5  # checkpoints at steps 5, 10, 15, 20 (mid-epoch: 0/5, 1/2, 1/7, 2/4)
CRASH_AT = 13
KILL_AT = 15

out, mode = sys.argv[1], sys.argv[2]
accelerator = Accelerator(project_dir=os.path.join(out, "project"))
rank = accelerator.process_index
root = os.path.join(out, "project", "checkpoints")

set_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=g)
y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(64, 1, generator=g)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)


def weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def once(name: str) -> bool:
    """True the first time only (in any attempt): a marker file in OUT remembers."""
    path = os.path.join(out, name)
    if os.path.exists(path):
        return False
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return True


def die_halfway_through_the_next_torch_save() -> None:
    real_save = torch.save

    def save_half_then_die(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_half_then_die


record: dict = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "rank": rank}
found = sorted(e for e in os.listdir(root) if e != ".hasten-lock") if os.path.isdir(root) else []
record["found"] = found
partial = [name for name in found if ".tmp-" in name]
if partial:
    directory = os.path.join(root, partial[0])
    record["partial_has_manifest"] = os.path.exists(os.path.join(directory, "hasten_checkpoint.json"))
    record["partial_files"] = {name: os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)}
    newest = [name for name in found if name.startswith("checkpoint_")][-1]
    with open(os.path.join(root, newest, "hasten_checkpoint.json")) as f:
        record["complete_files"] = {name: entry["size"] for name, entry in json.load(f)["files"].items()}
    before = weights()
    try:
        accelerator.load_state(directory)
        record["partial_refused"] = None
    except ValueError as err:
        record["partial_refused"] = str(err)
    record["unchanged_after_refusal"] = all(torch.equal(before[k], v) for k, v in weights().items())
if any(name.startswith("checkpoint_") for name in found):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record["loaded"] = os.path.basename(accelerator.load_state())
    record["passed_over"] = [str(w.message) for w in caught if "passed over" in str(w.message)]
    record["loaded_step"] = accelerator.step
    saved = torch.load(os.path.join(out, f"saved_step{accelerator.step}_rank{rank}.pt"))
    record["loaded_weights_are_the_saved_ones"] = all(torch.equal(saved[k], v) for k, v in weights().items())

for _epoch in range(loader.epoch, EPOCHS):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step = accelerator.step
        if mode == "crash_once" and rank == 1 and step == CRASH_AT and once("crashed"):
            raise RuntimeError(f"rank 1 crashes once, after step {step}")
        if step % SAVE_EVERY == 0:
            if mode == "kill_in_save" and rank == 0 and step == KILL_AT and once("killed"):
                die_halfway_through_the_next_torch_save()
            accelerator.save_state(total_limit=2)
            torch.save(weights(), os.path.join(out, f"saved_step{step}_rank{rank}.pt"))

record["end_step"] = accelerator.step
record["left"] = sorted(e for e in os.listdir(root) if e != ".hasten-lock")
with open(os.path.join(out, f"attempts_rank{rank}.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")
torch.save(weights(), os.path.join(out, f"final_rank{rank}.pt"))
