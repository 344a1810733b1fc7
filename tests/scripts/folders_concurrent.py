"""One run of one process saving again and again into one explicit checkpoint folder.

usage: folders_concurrent.py FOLDER OUT_JSON SAVES GO_FILE

Two of these run at once on the same FOLDER (the test starts both, then creates GO_FILE so that
their saves overlap). A pre-hook makes each save last a little, so the two runs' saves do meet.
Writes OUT_JSON: this run's pid and host, how many saves it made, the message of each save
refused with a CheckpointError, and any other error (there must be none).
"""

import json
import os
import socket
import sys
import time

import torch

from hasten import Accelerator
from hasten.checkpoint import CheckpointError

folder, out, saves, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(3, 3))
accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: time.sleep(0.02))
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
record = {"pid": os.getpid(), "host": socket.gethostname(), "saved": 0, "refused": [], "failed": []}
for i in range(saves):
    with torch.no_grad():
        model.weight.fill_(float(os.getpid() % 1000 + i))
    try:
        accelerator.save_state(folder)
        record["saved"] += 1
    except CheckpointError as e:
        record["refused"].append(str(e))
    except Exception as e:  # noqa: BLE001 - recorded: the test requires there be none
        record["failed"].append(f"{type(e).__name__}: {e}")
    time.sleep(0.01)  # the training steps between two saves
with open(out, "w") as f:
    json.dump(record, f)
