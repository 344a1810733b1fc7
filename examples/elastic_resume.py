"""Resume-or-start: the training loop of an elastic or requeued run (see README "Resizing and restarts").

    hasten launch --num_processes 2 examples/elastic_resume.py --project_dir runs/x --stop_after 3
    hasten launch --num_processes 3 examples/elastic_resume.py --project_dir runs/x   # resumes at 3

It checkpoints every --save_every steps into project_dir/checkpoints (atomically, newest kept);
a start finds the newest complete checkpoint and continues from it, at any number of processes,
or starts fresh when there is none. Each process appends the sample indices it trained on to
project_dir/seen_rank{R}_{WORLD}.txt, so that a run can be checked: every sample of an epoch once.
--stop_after N stops after N steps, as a killed or preempted run would (after its last save).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ProjectConfiguration


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project_dir", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch_size", type=int, default=4, help="per process")
    p.add_argument("--save_every", type=int, default=1, help="steps between checkpoints")
    p.add_argument("--stop_after", type=int, default=None, help="stop after this many steps (a simulated kill)")
    args = p.parse_args()

    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
        )
    )
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(args.samples), torch.randn(args.samples, 8), torch.randn(args.samples, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if accelerator.load_state(missing_ok=True) is None:
        accelerator.print("no checkpoint yet: starting fresh")
    else:
        accelerator.print(f"resumed from {accelerator.checkpoint_state.directory} at epoch {loader.epoch}")
    os.makedirs(args.project_dir, exist_ok=True)
    log = os.path.join(args.project_dir, f"seen_rank{accelerator.process_index}_{accelerator.num_processes}.txt")
    steps = 0
    for epoch in range(loader.epoch, args.epochs):
        model.train()
        for index, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            with open(log, "a") as f:
                f.write(f"{epoch} {' '.join(str(int(i)) for i in index)}\n")
            steps += 1
            if steps % args.save_every == 0:
                accelerator.save_state()
            if args.stop_after is not None and steps >= args.stop_after:
                accelerator.print(f"stopping after {steps} steps")
                return
        accelerator.print(f"epoch {epoch} done on {accelerator.num_processes} process(es), loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
