"""What ``import accelerate`` gives in this process: run by ``hasten launch --as_accelerate``.

usage: python as_accelerate_probe.py OUT_DIR   (writes OUT_DIR/rank{RANK}.json)
"""

import importlib.metadata
import json
import os
import sys

import accelerate
import accelerate.utils
from accelerate import Accelerator, PartialState

import hasten
import hasten.utils
from hasten.compat.as_accelerate import is_installed

state = PartialState()
facts = {
    "installed": is_installed(),
    "same_accelerator": Accelerator is hasten.Accelerator,
    "same_utils": sys.modules["accelerate.utils"] is hasten.utils,
    "version": accelerate.__version__,
    "metadata_version": importlib.metadata.version("accelerate"),
    "rank": state.process_index,
    "world": state.num_processes,
    "argv": sys.argv[1:],
    "main": __name__,
}
with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(facts, f)
