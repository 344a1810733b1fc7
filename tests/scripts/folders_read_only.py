"""A finished run's project_dir, read-only: Accelerator(...) constructs, load_state loads, save_state refuses.

usage: folders_read_only.py PROJECT_DIR OUT_JSON

Run inside a mount namespace where PROJECT_DIR is a read-only bind mount. Writes OUT_JSON: the
folder loaded, the weights loaded, and the refused save's error.
"""

import json
import sys

import torch

from hasten import Accelerator, ProjectConfiguration
from hasten.checkpoint import CheckpointError

project, out = sys.argv[1], sys.argv[2]
record = {}
accelerator = Accelerator(
    cpu=True, project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
)
model = accelerator.prepare(torch.nn.Linear(3, 3))
record["loaded"] = accelerator.load_state()
record["weight"] = model.weight.detach().tolist()
try:
    accelerator.save_state()
except CheckpointError as e:
    record["refused"] = f"{type(e).__name__}: {e}"
with open(out, "w") as f:
    json.dump(record, f)
