"""A replica group of 2 processes whose lighthouse does not answer (tests/test_fault_tolerance.py).

argv: OUT LIGHTHOUSE. Every rank must get the error itself (rank 1 used to wait for ever for the
group's manager address, which rank 0 never published): each writes OUT/rank{r}.txt with the
error's type and message, then exits 3.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from hasten import Accelerator, FaultToleranceKwargs

out, lighthouse = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
try:
    Accelerator(kwargs_handlers=[FaultToleranceKwargs(lighthouse=lighthouse, connect_timeout=timedelta(seconds=2))])
except Exception as e:  # noqa: BLE001 - what each rank got is the test's
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{type(e).__name__}: {e}")
    sys.exit(3)
