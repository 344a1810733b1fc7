"""One rank stops; the others must end after the process-group timeout (read by tests/test_timeouts.py).

usage: timeout_hang.py OUT (hsdp | async) SECONDS

Every rank builds its Accelerator with ``InitProcessGroupKwargs(timeout=SECONDS)``, trains a
step and writes OUT/rank{R}.json: its pid, the time, and the timeout of every process group its
run holds (each mesh dim, the flattened dims, FSDP's mesh, the asynchronous saves' group), before
one rank stops:

* hsdp (4 processes): HSDP 2x2 (``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``);
  rank 3 sleeps before its next forward, the others train on.
* async (2 processes): FSDP2 on a 1-D mesh; an asynchronous ``save_state``, then rank 1 freezes
  itself (SIGSTOP) with its writer thread; rank 0 trains on and waits for the save.

A rank that gets past the stopped one prints "trained past the stopped rank".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from hasten import Accelerator, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ParallelismConfig  # noqa: E402
from hasten.checkpoint import background  # noqa: E402
from hasten.settings.groups import timeout_of  # noqa: E402
from hasten.settings.parallelism import MESH_DIMS  # noqa: E402

out, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
handler = InitProcessGroupKwargs(timeout=timedelta(seconds=seconds))
if mode == "hsdp":
    from nd_common import Net

    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    acc = Accelerator(kwargs_handlers=[handler], parallelism_config=config)
    model, stopping = Net(), 3
else:
    from fsdp_common import make_model

    config = None
    acc = Accelerator(
        kwargs_handlers=[handler], fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    )
    model, stopping = make_model(seed=1), 1
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
rank = acc.process_index


def step() -> None:
    x = torch.randn(4, 8)
    loss = nn.functional.mse_loss(model(x).float().sum(-1), torch.zeros(4))
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def timeouts() -> dict[str, float]:
    groups = {f"fsdp_{i}": g for i, g in enumerate(acc.strategy.mesh.get_all_groups())}
    if config is not None:
        groups.update({d: acc.torch_device_mesh.get_group(d) for d in MESH_DIMS})
        groups.update({name: flat.get_group() for name, flat in config.flattened.items()})
    groups["async_save"] = background.group()  # a collective: every rank makes it here
    return {name: timeout_of(g).total_seconds() for name, g in groups.items()}


step()
found = timeouts()
if mode == "async":
    acc.save_state(os.path.join(out, "ck"), async_save=True)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "time": time.time(), "timeouts": found}, f)
if rank == stopping:
    if mode == "hsdp":
        time.sleep(600)
    else:
        os.kill(os.getpid(), signal.SIGSTOP)
for _ in range(3):
    step()
acc.wait_for_checkpoint()
print(f"rank {rank} trained past the stopped rank", flush=True)
acc.end_training()
