"""One small training script for Accelerate, run as it is and with `from accelerate` -> `from hasten`.

tests/test_same_numbers.py runs it on 1 and 2 processes under both libraries and compares every
step's loss and learning rate and each epoch's evaluation loss; and, under hasten, compares a run
stopped at a mid-epoch checkpoint and resumed in a fresh process with the uninterrupted run.

What it uses, because each changes the numbers when a library gets it wrong: dropout (the
global random stream), a shuffled DataLoader whose last batch is short (the order; the padding
on 2 processes), gradient accumulation, a warm-up/decay schedule sized the way the transformers
examples size it (times num_processes), clipping, and an evaluation loop that gathers
`loss.repeat(batch_size)` with gather_for_metrics (the last batch's padding must go).

usage: same_numbers_train.py OUT_DIR MODE[,MODE...] [STOP_EPOCH STOP_BATCH]
    straight: EPOCHS epochs; stop: save to OUT_DIR/ckpt after batch STOP_BATCH of epoch
    STOP_EPOCH and stop; resume: load OUT_DIR/ckpt and finish (hasten only: it reads the
    prepared loader's epoch and position). Several modes run one after the other in the same
    processes (hasten only: Accelerate keeps one state per process). Each process writes
    OUT_DIR/{mode}_rank{r}.json.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 3
BATCH_SIZE = 4
ACCUMULATION = 2


def main(out_dir: str, mode: str, stop_at: tuple[int, int] | None) -> None:
    set_seed(42)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    g = torch.Generator().manual_seed(0)  # the data do not depend on the global stream
    x = torch.randn(39, 6, generator=g)
    y = torch.sin(x @ torch.randn(6, 1, generator=g)) + 0.1 * torch.randn(39, 1, generator=g)
    train = DataLoader(TensorDataset(x[:30], y[:30]), batch_size=BATCH_SIZE, shuffle=True)  # 8 batches, last of 2
    evaluation = DataLoader(TensorDataset(x[30:], y[30:]), batch_size=BATCH_SIZE)  # 9 samples: 4, 4, 1
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    # Sized as the transformers examples size it: optimizer steps of one process times num_processes.
    steps = -(-len(train) // accelerator.num_processes // ACCUMULATION) * EPOCHS * accelerator.num_processes
    warmup = 2 * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warmup if s < warmup else max(0.0, (steps - s) / (steps - warmup))
    )
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)

    first_epoch, first_batch = 0, 0
    if mode == "resume":
        accelerator.load_state(os.path.join(out_dir, "ckpt"))
        first_epoch, first_batch = train.epoch, train.batches_yielded  # hasten's resumable position
    records, evals = [], []
    for epoch in range(first_epoch, EPOCHS):
        model.train()
        batch = first_batch if epoch == first_epoch else 0
        for bx, by in train:
            batch += 1
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(bx), by)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            records.append({"epoch": epoch, "batch": batch, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
            if mode == "stop" and (epoch, batch) == stop_at:
                accelerator.save_state(os.path.join(out_dir, "ckpt"))
                return write(out_dir, mode, accelerator, records, evals)
        model.eval()
        losses = []
        with torch.no_grad():
            for bx, by in evaluation:
                loss = F.mse_loss(model(bx), by)
                losses.append(accelerator.gather_for_metrics(loss.repeat(BATCH_SIZE)))
        losses = torch.cat(losses)
        evals.append({"epoch": epoch, "loss": losses.mean().item(), "count": losses.numel()})
    write(out_dir, mode, accelerator, records, evals)


def write(out_dir, mode, accelerator, records, evals) -> None:
    path = os.path.join(out_dir, f"{mode}_rank{accelerator.process_index}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "num_processes": accelerator.num_processes,
                "records": records,
                "evals": evals,
                "after": torch.rand(2).tolist(),
            },
            f,
        )


if __name__ == "__main__":
    stop = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None
    for mode in sys.argv[2].split(","):
        main(sys.argv[1], mode, stop)
