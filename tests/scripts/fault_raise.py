"""Rank 1 raises in the middle of a training step or inside the gradient all-reduce.

usage: fault_raise.py (step | collective)

Rank 0 trains on: at the failing step it waits in DDP's all-reduce for a rank that will
never come (the process-group timeout is the default 30 minutes), so only the launcher
stopping it ends the run within the test's timeout.
"""

import sys

import torch

from hasten import Accelerator

FAIL_AT = 3
where = sys.argv[1]
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
failing = accelerator.process_index == 1
calls = 0

if where == "collective" and failing:

    def allreduce_then_fail(state, bucket):
        global calls
        calls += 1
        if calls > FAIL_AT:
            raise RuntimeError("boom inside the gradient all-reduce on rank 1")
        return torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, allreduce_then_fail)

for step in range(10**6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if where == "step" and failing and step == FAIL_AT:
        raise RuntimeError("boom mid-step on rank 1")
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
