"""Run by 2 processes: dataloaders prepared with dispatch_batches=True (tests/test_dropin_data.py).

usage: dispatch_checks.py OUT_DIR

Each rank writes OUT_DIR/rank{r}.json; OUT_DIR/ckpt is a checkpoint saved in the middle of an
epoch of two dispatched loaders, which the test resumes on one process.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.data_loader.dispatch import DataLoaderDispatcher
from hasten.utils import set_seed

out_dir = sys.argv[1]
res: dict = {}


def dispatching(**config) -> Accelerator:
    return Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True, **config))


class Stream(IterableDataset):
    """0..n-1, each as a 1-element tensor; fails at item ``fail_at`` when given."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at = n, fail_at

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise KeyError(f"sample {i} is missing")
            yield torch.tensor(i)


def walk(acc: Accelerator, loader) -> dict:
    """This rank's batches, the loop's facts at each, and what gather_for_metrics keeps."""
    batches, ends, remainders, kept = [], [], [], []
    for batch in loader:
        batches.append(batch.tolist())
        ends.append(acc.gradient_state.end_of_dataloader)
        remainders.append(acc.gradient_state.remainder if acc.gradient_state.end_of_dataloader else None)
        kept.append(acc.gather_for_metrics(batch).tolist())
    try:
        length = len(loader)
    except TypeError:  # a stream without a length
        length = None
    return {
        "batches": batches,
        "ends": ends,
        "remainders": remainders,
        "kept": kept,
        "len": length,
        "kind": type(loader).__name__,
        "active_after": acc.gradient_state.active_dataloader is None,
    }


acc = dispatching()
rank = acc.process_index
res["whole"] = walk(acc, acc.prepare(DataLoader(list(range(10)), batch_size=2)))
res["padded"] = walk(acc, acc.prepare(DataLoader(list(range(11)), batch_size=2)))
res["stream"] = walk(acc, acc.prepare(DataLoader(Stream(11), batch_size=2)))
res["drop_last"] = walk(acc, acc.prepare(DataLoader(list(range(10)), batch_size=2, drop_last=True)))
split = dispatching(split_batches=True)
res["split"] = walk(split, split.prepare(DataLoader(list(range(10)), batch_size=4)))

# Shuffled: the main process draws the order from its global generator, as a plain DataLoader.
set_seed(5)
reference = [int(i) for b in DataLoader(list(range(12)), batch_size=3, shuffle=True) for i in b]
set_seed(5)
shuffled = acc.prepare(DataLoader(list(range(12)), batch_size=3, shuffle=True))
res["shuffled"] = {"reference": reference, "gathered": [acc.gather(b).tolist() for b in shuffled]}


# Batches of dicts with a string and tensors whose shapes differ between processes.
def collate(items):
    width = 1 + items[0] % 3
    return {"x": torch.stack([torch.full((width,), float(i)) for i in items]), "tag": f"from {items[0]}"}


structured = acc.prepare(DataLoader(list(range(10)), batch_size=2, collate_fn=collate))
res["structured"] = [{"x": b["x"].tolist(), "tag": b["tag"]} for b in structured]

# The main process fails while reading: every process raises instead of waiting.
try:
    for _ in acc.prepare(DataLoader(Stream(10, fail_at=5), batch_size=2)):
        pass
    res["failure"] = None
except Exception as e:  # noqa: BLE001 - the message is the result
    res["failure"] = f"{type(e).__name__}: {e}"

# Mid-epoch resume at the same number of processes, from the position alone.
for name, make in {
    "map": lambda: DataLoader(list(range(20)), batch_size=2, shuffle=True),
    "stream": lambda: DataLoader(Stream(21), batch_size=2),
}.items():
    set_seed(7)
    straight = [b.tolist() for b in acc.prepare(make())]
    set_seed(7)
    first = acc.prepare(make())
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    position = first.state_dict()
    del it
    second = acc.prepare(make())
    second.load_state_dict(position)
    res[f"resume_{name}"] = {"straight": straight, "resumed": head + [b.tolist() for b in second]}

# A checkpoint in the middle of an epoch, which the test resumes on one process.
set_seed(11)
saver = Accelerator(project_dir=out_dir, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
model = saver.prepare(torch.nn.Linear(1, 1))
loaders = saver.prepare(DataLoader(list(range(13)), batch_size=2, shuffle=True), DataLoader(Stream(13), batch_size=2))
res["saved_kinds"] = [isinstance(dl, DataLoaderDispatcher) for dl in loaders]
iterators = [iter(dl) for dl in loaders]
res["before_save"] = [[saver.gather(next(it)).tolist() for _ in range(2)] for it in iterators]
saver.save_state(os.path.join(out_dir, "ckpt"))

with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(res, f)
