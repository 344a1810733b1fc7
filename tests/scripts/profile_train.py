"""Run by 2 processes: a profiled training loop; traces + one JSON file of facts per rank.

usage: profile_train.py OUT_DIR [--demo]

Writes OUT_DIR/traces/trace_rank<r>_cycle<k>.json (through accelerator.profile()) and
OUT_DIR/rank<r>.json with what each rank saw. Without --demo: gradient accumulation over 2
micro-steps and a schedule with two active cycles, stepped by the optimizer. With --demo (the
README picture): a longer run in which rank 1's data pipeline is slower, a straggler to find.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProfileKwargs
from hasten.data_loader.core import DataLoaderShard
from hasten.training.profiling import is_profiling

out_dir = sys.argv[1]
demo = "--demo" in sys.argv[2:]
trace_dir = os.path.join(out_dir, "traces")

torch.manual_seed(0)
accelerator = Accelerator(gradient_accumulation_steps=1 if demo else 2)
rank = accelerator.process_index
width = 256 if demo else 32
model = torch.nn.Sequential(
    torch.nn.Linear(64, width),
    torch.nn.GELU(),
    torch.nn.Linear(width, width),
    torch.nn.GELU(),
    torch.nn.Linear(width, 8),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
data = TensorDataset(
    torch.randn(512 if demo else 96, 64, generator=g), torch.randn(512 if demo else 96, 8, generator=g)
)


def collate(batch):
    if demo and rank == 1:
        time.sleep(0.003)  # the straggler: a slower input pipeline on rank 1 (demo picture only)
    return torch.utils.data.default_collate(batch)


loader = DataLoader(data, batch_size=16 if demo else 8, shuffle=True, collate_fn=collate)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

trace_ready = []
if demo:
    schedule = {"wait": 1, "warmup": 2, "active": 8, "repeat": 1}
else:
    # 2 epochs x 6 micro-steps / 2 accumulation = 6 optimizer steps: cycles end at steps 3 and 6.
    schedule = {"wait": 0, "warmup": 1, "active": 2, "repeat": 2}
handler = ProfileKwargs(
    activities=["cpu"],
    schedule_option=schedule,
    on_trace_ready=lambda prof: trace_ready.append(prof.step_num),
    output_trace_dir=trace_dir,
    step_with_optimizer=True,
    record_shapes=True,
)

during: dict = {}
with accelerator.profile(handler) as prof:
    during = {
        "is_profiling": is_profiling(accelerator),
        "loader_class_swapped": type(loader) is not DataLoaderShard and isinstance(loader, DataLoaderShard),
        "forward_labelled": getattr(model.forward, "_hasten_label", None),
        "backward_labelled": getattr(accelerator.precision.around_backward, "_hasten_label", None),
        "step_labelled": getattr(optimizer.step, "_hasten_label", None),
    }
    for _epoch in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                with accelerator.record_function("user.loss"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
# The main process returns from profile() only once every rank has written its traces.
traces_after_exit = sorted(os.listdir(trace_dir)) if rank == 0 else None

result = {
    "rank": rank,
    "world_size": accelerator.num_processes,
    "during": during,
    "after": {
        "is_profiling": is_profiling(accelerator),
        "loader_class": type(loader).__name__,
        "loader_class_restored": type(loader) is DataLoaderShard,
        "forward_in_dict": "forward" in model.__dict__,
        "backward_in_dict": "backward" in accelerator.__dict__,
        "step_in_dict": "step" in optimizer.__dict__,
    },
    "trace_ready_steps": trace_ready,
    "profiler_step_num": prof.step_num,
    "real_steps": optimizer.real_steps,
    "traces_after_exit": traces_after_exit,
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
accelerator.end_training()
