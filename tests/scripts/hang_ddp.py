"""Rank 1 sleeps before ``backward`` while rank 0 waits in DDP's gradient all-reduce: the
process-group timeout (TIMEOUT seconds) ends the run, and the launcher must name rank 1.

usage: hang_ddp.py TIMEOUT
"""

import sys
import time
from datetime import timedelta

import torch

from hasten import Accelerator, InitProcessGroupKwargs

timeout = timedelta(seconds=float(sys.argv[1]))
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.ones(2, 4)).sum()
if accelerator.process_index == 1:
    time.sleep(600)
accelerator.backward(loss)
optimizer.step()
print("step done", flush=True)
