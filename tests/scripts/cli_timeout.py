"""Rank 1 never joins an all_reduce: rank 0 must fail after the 5 s process-group timeout."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hasten import Accelerator, InitProcessGroupKwargs

accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=5))])
if accelerator.process_index == 1:
    time.sleep(600)  # hung rank: far beyond the test's timeout
dist.all_reduce(torch.ones(1))
print("all_reduce returned", flush=True)
