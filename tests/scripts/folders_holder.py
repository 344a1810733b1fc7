"""Hold a checkpoint folder the way a live run does, until stdin closes.

usage: folders_holder.py claim PARENT NAME   (a save of PARENT/NAME in progress: its lock held,
                                              its temporary folder .NAME.tmp-TOKEN present)
       folders_holder.py project PROJECT_DIR (a run with automatic checkpoint naming)

Prints "held" once it holds it.
"""

import os
import sys

from hasten.checkpoint import locks

if sys.argv[1] == "claim":
    parent, name = sys.argv[2], sys.argv[3]
    held = locks.claim(parent, name)
    os.mkdir(os.path.join(parent, f".{name}.tmp-0123456789ab"))
else:
    from hasten import Accelerator, ProjectConfiguration

    held = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[2], automatic_checkpoint_naming=True))
print("held", flush=True)
sys.stdin.read()
