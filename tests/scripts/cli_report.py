"""One rank's view of a `hasten launch` run, written to OUT/rank{RANK}.json for tests/test_cli.py.

usage: cli_report.py OUT [--code-steps N] [anything else, recorded as given]

Builds `Accelerator()` (with gradient_accumulation_steps=N in code when --code-steps is given),
records what it took from the launcher (flags, environment, config-file handlers), prepares a
model (so the DDP object's bucket size can be read), and trains a few deterministic steps.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from hasten import Accelerator

out = sys.argv[1]
code_steps = int(sys.argv[sys.argv.index("--code-steps") + 1]) if "--code-steps" in sys.argv else None

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    accelerator = Accelerator(gradient_accumulation_steps=code_steps)

torch.manual_seed(0)
model = accelerator.prepare(torch.nn.Linear(4, 1))
optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

report = {
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "local_rank": accelerator.local_process_index,
    "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
    "group_rank": os.environ.get("GROUP_RANK"),
    "machine_tag": os.environ.get("CLI_TEST_MACHINE"),
    "mixed_precision": accelerator.mixed_precision,
    "steps": accelerator.gradient_accumulation_steps,
    "device": str(accelerator.device),
    "backend": accelerator.state.backend,
    "bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
    "ddp_comm_hook": str(accelerator.ddp_handler.comm_hook) if accelerator.ddp_handler else None,
    "pg_timeout_s": accelerator.init_handler.timeout.total_seconds() if accelerator.init_handler else None,
    "warnings": [str(w.message) for w in caught],
    "argv": sys.argv,
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "hasten_env": {k: v for k, v in os.environ.items() if k.startswith("HASTEN_") and k != "HASTEN_CONFIG_HOME"},
    "rank_env": os.environ.get("RANK"),
    "loss": round(loss.item(), 6),
}
if accelerator.use_distributed:
    total = torch.tensor([accelerator.process_index + 1.0])
    dist.all_reduce(total)
    report["rank_sum"] = total.item()
with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(report, f)
