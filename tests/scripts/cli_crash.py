"""Rank FAIL raises right after start; the other ranks sleep until the launcher stops them.

usage: cli_crash.py FAIL
"""

import sys
import time

from hasten import Accelerator

accelerator = Accelerator()
if accelerator.process_index == int(sys.argv[1]):
    raise RuntimeError(f"boom from rank {accelerator.process_index}")
time.sleep(600)  # far beyond the test's timeout: only the launcher stopping this rank ends it
