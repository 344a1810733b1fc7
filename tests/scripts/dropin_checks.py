"""Run by 2 processes: the Accelerate drop-in names (tests/test_dropin.py), one JSON file per rank.

usage: dropin_checks.py OUT_DIR
"""

from __future__ import annotations

import io
import json
import sys
import time
from contextlib import redirect_stdout

import torch
from torch.utils.data import DataLoader, IterableDataset

from hasten import Accelerator, AcceleratorState, DistributedType, GradientState, PartialState, skip_first_batches
from hasten.data_loader import IterableDatasetShard, prepare_data_loader
from hasten.utils import DistributedOperationException, reduce, synchronize_rng_states

out_dir = sys.argv[1]
res: dict = {}
state = PartialState()
rank = state.process_index
t = torch.tensor([float(rank + 2)])  # 2 on rank 0, 3 on rank 1
res["reduce"] = {r: reduce(t, r).item() for r in ("sum", "mean", "max", "min", "product", "none")}
res["reduce_default"] = reduce(t).item()

# PartialState's helpers.
with state.split_between_processes(list(range(5))) as part:
    res["split"] = part
with state.split_between_processes(list(range(5)), apply_padding=True) as part:
    res["split_padded"] = part
order = []
with state.main_process_first():
    order.append(time.monotonic())
    if rank == 0:
        time.sleep(0.5)
res["main_first_t"] = order[0]
res["on_main"] = state.on_main_process(lambda: "ran")()
res["on_last"] = state.on_last_process(lambda: "ran")()
res["on_process_1"] = state.on_process(process_index=1)(lambda: "ran")()
buf = io.StringIO()
with redirect_stdout(buf):
    state.print("hello from", rank)
res["printed"] = buf.getvalue()
res["distributed_type_xla"] = state.distributed_type == DistributedType.XLA
res["distributed_type"] = str(state.distributed_type)

# Debug mode: mismatched shapes are reported instead of hanging.
state.debug = True
try:
    reduce(torch.zeros(2 + rank))
    res["debug_raised"] = None
except DistributedOperationException as e:
    res["debug_raised"] = str(e)
state.debug = False

# synchronize_rng_states: every process ends with rank 0's CPU generator state.
torch.manual_seed(100 + rank)
synchronize_rng_states(["torch"])
res["rng_after_sync"] = torch.rand(3).tolist()

# AcceleratorState / GradientState agree with the most recent Accelerator.
acc = Accelerator(gradient_accumulation_steps=4)
a_state = AcceleratorState()
res["acc_state"] = {
    "num_processes": a_state.num_processes,
    "process_index": a_state.process_index,
    "mixed_precision": a_state.mixed_precision,
    "device": str(a_state.device),
    "distributed_type": str(a_state.distributed_type),
    "is_main": a_state.is_main_process,
}
res["gradient_state_same"] = GradientState() is acc.gradient_state and GradientState().num_steps == 4

# Accelerate's prepare_data_loader signature, on the real world size; free skip_first_batches.
loader = prepare_data_loader(DataLoader(list(range(16)), batch_size=2))
res["prepared_batches"] = [b.tolist() for b in loader]
skipped = skip_first_batches(acc.prepare(DataLoader(list(range(16)), batch_size=2)), 2)
res["skipped_batches"] = [b.tolist() for b in skipped]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


res["iterable_shard"] = list(IterableDatasetShard(Stream(), batch_size=2, num_processes=2, process_index=rank))
# Each process reads its own share (dispatch_batches=False), or (the default for a stream, as in
# Accelerate) the main process reads and sends each process its part.
res["iterable_prepared"] = [
    b.tolist() for b in prepare_data_loader(DataLoader(Stream(), batch_size=2), dispatch_batches=False)
]
dispatched = acc.prepare(DataLoader(Stream(), batch_size=2))
res["iterable_dispatched"] = {"kind": type(dispatched).__name__, "batches": [b.tolist() for b in dispatched]}

# trigger_sync_in_backward: forwards under no_sync, then backwards; only the triggered one all-reduces.
sync_acc = Accelerator()
torch.manual_seed(0)
ddp = sync_acc.prepare(torch.nn.Linear(3, 1))
losses = []
for i in range(2):
    with sync_acc.no_sync(ddp):
        losses.append(ddp(torch.full((1, 3), float(rank + 1 + i))).sum())
sync_acc.backward(losses[0])
res["grad_after_local_backward"] = ddp.module.weight.grad.tolist()
with sync_acc.trigger_sync_in_backward(ddp):
    sync_acc.backward(losses[1])
res["grad_after_triggered_backward"] = ddp.module.weight.grad.tolist()

state.destroy_process_group()
res["destroyed"] = not torch.distributed.is_initialized()
state.destroy_process_group()  # safe twice
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(res, f)
