"""Each rank writes its pid to OUT/pid{RANK} and sleeps; the test signals the launcher.

usage: cli_sleep.py OUT
"""

import os
import sys
import time

from hasten import Accelerator

accelerator = Accelerator()
path = os.path.join(sys.argv[1], f"pid{accelerator.process_index}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(600)
