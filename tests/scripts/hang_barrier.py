"""Rank 0 waits in a barrier, rank 1 sleeps: stuck until the (default, long) timeout. Each rank
writes OUT/ready{RANK} just before, so the test knows when to press Ctrl-C.

usage: hang_barrier.py OUT
"""

import os
import sys
import time

from hasten import Accelerator

accelerator = Accelerator(cpu=True)
with open(os.path.join(sys.argv[1], f"ready{accelerator.process_index}"), "w") as f:
    f.write(str(os.getpid()))
if accelerator.process_index == 0:
    accelerator.wait_for_everyone()  # waits for rank 1 for good
else:
    time.sleep(600)
