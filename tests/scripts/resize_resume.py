"""Resume at another number of processes: which samples each rank sees, RNG states, the warning.

    resize_resume.py OUT save      (2 processes) an epoch over two loaders; save_state to OUT/ckpt
                                   after SAVE_AFTER batches per rank, then finish the epoch
    resize_resume.py OUT resume    (any number) load OUT/ckpt, finish the interrupted epoch
    ... fsdp                       the same with FSDP2 (a sharded "dcp" checkpoint, resharded)

Each process writes OUT/{phase}_{world_size}_rank{r}.json (fsdp_{phase}_... with FSDP).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, FullyShardedDataParallelPlugin

SAVE_AFTER = 2
SIZES = {"even": 30, "padded": 32}  # batches of 3: 10 (no padding at 1, 2 or 3 processes), 11 (padding at 3)


def build(fsdp: bool) -> tuple[Accelerator, dict[str, DataLoader]]:
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin() if fsdp else None)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1))
    torch.manual_seed(1234 + acc.process_index)  # per-rank global states, as a real run may have
    loaders = {
        name: DataLoader(TensorDataset(torch.arange(n)), batch_size=3, shuffle=True) for name, n in SIZES.items()
    }
    prepared = acc.prepare(model, *loaders.values())
    return acc, dict(zip(loaders, prepared[1:]))


def indices(batch) -> list[int]:
    return [int(i) for i in batch[0]]


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    fsdp = sys.argv[3:] == ["fsdp"]
    acc, loaders = build(fsdp)
    ckpt = os.path.join(out, "ckpt_fsdp" if fsdp else "ckpt")
    result: dict = {"seen": {}, "duplicates": {}}
    if phase == "save":
        iterators = {name: iter(dl) for name, dl in loaders.items()}
        before = {name: [indices(next(it)) for _ in range(SAVE_AFTER)] for name, it in iterators.items()}
        acc.save_state(ckpt)
        result["draw_after_save"] = torch.rand(3).tolist()
        result["before"] = before
        for name, it in iterators.items():
            result["seen"][name] = [indices(b) for b in it]
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.load_state(ckpt)
        result["warnings"] = [str(w.message) for w in caught]
        result["draw_after_load"] = torch.rand(3).tolist()
        for name, dl in loaders.items():
            result["seen"][name] = [indices(b) for b in dl]
            result["duplicates"][name] = dl.shard_sampler.duplicates
            result.setdefault("epoch", {})[name] = dl.epoch
        # a second epoch after the resumed one runs whole, at this number of processes
        result["next_epoch"] = [indices(b) for b in loaders["even"]]
    result["layout"] = json.load(open(os.path.join(ckpt, "hasten_checkpoint.json")))["layout"]
    name = f"{'fsdp_' if fsdp else ''}{phase}_{acc.num_processes}_rank{acc.process_index}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
