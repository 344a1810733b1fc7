"""A worker whose library keeps a ThreadPoolExecutor alive after the script (torchft's Manager does):
it must exit when the script ends (tests/test_fault_tolerance.py)."""

import builtins
import os
from concurrent.futures import ThreadPoolExecutor

builtins._kept_pool = ThreadPoolExecutor(max_workers=1)  # referenced beyond the script's globals
# one write per line: two workers share the launcher's stdout, and print() writes in pieces
os.write(1, f"POOL {builtins._kept_pool.submit(lambda: 41 + 1).result()}\n".encode())
