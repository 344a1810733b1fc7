"""Mid-epoch resume keeping the global batch at another number of processes (issue 57).

    round6_resume_global_batch.py OUT save     2 processes x batch 2: SAVE_AFTER steps, save_state to OUT/ckpt
    round6_resume_global_batch.py OUT resume   1 process x batch 4: load OUT/ckpt, finish the epoch
    round6_resume_global_batch.py OUT whole    1 process x batch 4: the same epoch, uninterrupted

The order comes from a seedable sampler (``data_seed``), the same at any number of processes.
Each process writes OUT/{phase}_rank{r}.json: the samples it saw per step and the losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration

SAVE_AFTER = 3
GLOBAL_BATCH = 4
N = 40  # 10 global batches of 4


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=11))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)
    dataset = TensorDataset(torch.arange(N), x, y)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // acc.num_processes, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    ckpt = os.path.join(out, "ckpt")
    if phase == "resume":
        acc.load_state(ckpt)
    result: dict = {"samples": [], "losses": []}
    for step, (idx, xb, yb) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        result["samples"].append(sorted(acc.gather(idx).tolist()))
        result["losses"].append(float(acc.reduce(loss.detach(), "mean")))
        if phase == "save" and step + 1 == SAVE_AFTER:
            acc.save_state(ckpt)
            break
    result["weight"] = [float(t) for t in torch.cat([p.detach().flatten() for p in model.parameters()])]
    with open(os.path.join(out, f"{phase}_rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
