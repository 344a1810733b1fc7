"""A run on a project_dir whose checkpoints folder another run holds: refused at Accelerator(...).

usage: fault_claimed_dir.py PROJECT_DIR OUT

With automatic checkpoint naming the folder is claimed when the Accelerator is built, so this
run must fail there; OUT/reached_rank{r} is written only if it got past that line.
"""

import os
import sys

from hasten import Accelerator, ProjectConfiguration

project, out = sys.argv[1], sys.argv[2]
accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
with open(os.path.join(out, f"reached_rank{accelerator.process_index}"), "w") as f:
    f.write("got past Accelerator(...)")
