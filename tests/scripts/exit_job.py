"""The smallest real two-process job, for the exit stress test (tests/test_exit.py).

usage: exit_job.py OUT [save]

Init the group (through Accelerator), a DDP model, one optimizer step, optionally
save_state to OUT/ckpt, then return: what is left is the exit itself.
"""

from __future__ import annotations

import os
import sys

import torch

from hasten import Accelerator

out = sys.argv[1]
accelerator = Accelerator(project_dir=out)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.ones(2, 4)).sum()
accelerator.backward(loss)
optimizer.step()
optimizer.zero_grad()
if "save" in sys.argv[2:]:
    accelerator.save_state(os.path.join(out, "ckpt"))
