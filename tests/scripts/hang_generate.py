"""FSDP2: the main process alone calls the sharded model's forward (through ``unwrap_model``, as
one generating text on the main process would), so it waits in an all-gather that rank 1 never
joins, while rank 1 waits in ``end_training``'s barrier. TIMEOUT seconds of process-group
timeout (0: the default) end it; the launcher must show both ranks' lines. With OUT, each rank
writes OUT/ready{RANK} first (for a test that presses Ctrl-C).

usage: hang_generate.py TIMEOUT [OUT]
"""

import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import make_model  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin, InitProcessGroupKwargs  # noqa: E402

handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=float(sys.argv[1])))] if float(sys.argv[1]) else []
accelerator = Accelerator(
    cpu=True,
    kwargs_handlers=handlers,
    fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
)
model = accelerator.prepare(make_model())
if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], f"ready{accelerator.process_index}"), "w") as f:
        f.write(str(os.getpid()))
if accelerator.is_main_process:
    generator = accelerator.unwrap_model(model)
    with torch.no_grad():
        sample = generator(torch.ones(1, 8))  # the forward: all-gathers on rank 0 only
    print("generated", sample.shape, flush=True)
accelerator.end_training()
