"""A long, plain training run for the health checks: memory, file descriptors, threads.

usage: soak_train.py OUT STEPS

The tiny benchmark model (32 -> 64 -> 10 MLP, cross-entropy, SGD) on 2 processes, with what
a real loop does besides stepping: a loss all-reduced for logging at every step, a shuffled
dataloader over many epochs, and a checkpoint every STEPS/8 steps (automatic naming,
total_limit=2). After a warm-up of STEPS/4 steps each rank samples its resident memory,
open file descriptors and threads every STEPS/20 steps, and writes OUT/rank{RANK}.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import psutil
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed

out, steps = sys.argv[1], int(sys.argv[2])
warmup, every, save_every = steps // 4, max(1, steps // 20), max(1, steps // 8)

accelerator = Accelerator(project_dir=os.path.join(out, "project"))
set_seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(1024, 32, generator=g), torch.randint(0, 10, (1024,), generator=g))
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=16, shuffle=True))

me = psutil.Process()
samples = []
step = 0
epoch = 0
while step < steps:
    loader.set_epoch(epoch)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        logged = accelerator.reduce(loss.detach(), "mean")
        step += 1
        if step % save_every == 0:
            accelerator.save_state(total_limit=2)
        if step >= warmup and (step - warmup) % every == 0:
            gc.collect()
            samples.append(
                {"step": step, "rss": me.memory_info().rss, "fds": me.num_fds(), "threads": me.num_threads()}
            )
        if step == steps:
            break
    epoch += 1

with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "steps": step, "epochs": epoch, "loss": logged.item(), "samples": samples}, f)
