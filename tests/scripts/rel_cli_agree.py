"""Rank 0 fails alone in a collective step (disk full while it writes), as in a checkpoint save:
hasten.distributed.ops.agree tells rank 1 "... failed on process 0: ...", and rank 0 cleans up for DELAY
seconds before its error reaches the top (a half-written checkpoint removed). Rank 1 sleeps in a
nested call when interrupted, so a Ctrl-C gives a long traceback per rank.

usage: rel_cli_agree.py OUT DELAY PATH     (DELAY "sleep": both ranks wait for a signal instead)
"""

import errno
import os
import sys
import time

from hasten import Accelerator
from hasten.distributed import ops

out, delay, path = sys.argv[1], sys.argv[2], sys.argv[3]
with open(os.path.join(out, f"started{os.environ.get('RANK', '0')}"), "w") as f:  # before anything can fail
    f.write(str(os.getpid()))
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index


def write_files() -> None:
    if rank == 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def save() -> None:
    try:
        ops.agree(rank, "save_state (writing)", write_files)
    finally:
        if rank == 0:
            time.sleep(float(delay))  # the cleanup of what was half written


def wait_in_a_save(depth: int) -> None:
    if depth:
        return wait_in_a_save(depth - 1)
    with open(os.path.join(out, f"ready{rank}"), "w") as f:
        f.write("ready")
    time.sleep(600)


if delay == "sleep":
    wait_in_a_save(20)
else:
    save()
