"""Each rank trains without end, its batches loaded by a DataLoader worker process; the test signals.

usage: fault_busy.py OUT

After its first step, each rank writes OUT/pids{RANK}.json: its own pid and those of its
DataLoader workers (grandchildren of the launcher, which must not outlive the run either).
"""

import json
import os
import sys

import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=1, persistent_workers=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

written = False
while True:
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if not written:
            me = psutil.Process()
            pids = {"rank": os.getpid(), "loader_workers": [p.pid for p in me.children(recursive=True)]}
            path = os.path.join(sys.argv[1], f"pids{accelerator.process_index}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(pids, f)
            os.replace(path + ".tmp", path)
            written = True
