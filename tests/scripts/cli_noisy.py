"""A run that makes noise on every rank: warnings, a profiler capture, then an ending.

usage: cli_noisy.py OUT MODE   (MODE: ok | raise | abort | print)

Writes OUT/rank{RANK}.json (OMP_NUM_THREADS, torch's thread count); every rank warns the same
warning, rank 1 also warns one naming its rank; both profile 4 steps (Kineto's USDT lines).
Then: ok ends; raise: rank 1 raises while rank 0 waits in an all-reduce (which then loses its
peer); abort: rank 1 calls os.abort() (SIGABRT, no Python exception) while rank 0 waits;
print: rank 0 prints 200,000 lines (for `| head`).
"""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from hasten import Accelerator

out, mode = sys.argv[1], sys.argv[2]
accelerator = Accelerator()
rank = accelerator.process_index
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads()}, f)
# no stacklevel: tests/test_launch_output.py checks that each warning names its own line here
warnings.warn("the same warning on every process")  # noqa: B028
if rank == 1:
    warnings.warn("rank 1 has its own warning")  # noqa: B028
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(4):
        torch.ones(64).sum()
        prof.step()
accelerator.wait_for_everyone()
if mode == "raise" and rank == 1:
    time.sleep(0.5)
    raise RuntimeError("boom from rank 1")
if mode == "abort" and rank == 1:
    time.sleep(0.5)
    os.abort()
if mode in ("raise", "abort"):
    dist.all_reduce(torch.ones(1))  # rank 0: fails when rank 1 is gone
    time.sleep(600)
if mode == "print" and rank == 0:
    for i in range(200_000):
        print(f"line {i}", flush=True)
accelerator.wait_for_everyone()
