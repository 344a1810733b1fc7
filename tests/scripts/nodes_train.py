"""One "node" of a two-node elastic run (tests/test_nodes.py, bench/scripts/node_loss.py).

    hasten launch --nnodes 1:2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT \\
        --max_restarts 3 ... nodes_train.py OUT --node A [--samples 96 --batch 2 --save_every 4 ...]

The documented resume-or-start loop (README "Resizing and restarts"): automatic checkpoint
naming under OUT/project, ``load_state(missing_ok=True)``, ``for epoch in range(loader.epoch,
epochs)``, a checkpoint every --save_every steps, and the process-group timeout the user
chooses (``InitProcessGroupKwargs(timeout=--pg_timeout s)``) so that a lost peer is detected in
seconds rather than after torch's default 30 minutes.

Every worker process (one per node and attempt) appends JSON lines to its own log
OUT/log_{node}_c{TORCHELASTIC_RESTART_COUNT}_w{world}_r{rank}_p{pid}.jsonl:

    {"event": "start", "node", "rank", "world", "restart", "pid", "resumed": N or null, "epoch", "t"}
    {"event": "step", "epoch", "indices": [...], "t"}      after each optimizer step
    {"event": "saving", "t"}                               before each save_state
    {"event": "saved", "iteration": N, "t"}                after it
    {"event": "done", "t"}                                 after the last epoch

--sleep slows each step down so that a kill or a join lands mid-epoch; --hold_after K makes a
fresh single-node start (world size 1, nothing to resume) stop training after K steps and
wait (at most --hold_max s) to be restarted by a joining node's rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, InitProcessGroupKwargs, ProjectConfiguration


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--node", required=True)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=2, help="per process")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save_every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--sleep", type=float, default=0.3, help="seconds of extra work per step")
    p.add_argument("--pg_timeout", type=float, default=20.0, help="process-group timeout, seconds")
    p.add_argument("--hold_after", type=int, default=None)
    p.add_argument("--hold_max", type=float, default=180.0)
    args = p.parse_args()

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=os.path.join(args.out, "project"), automatic_checkpoint_naming=True, total_limit=2
        ),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.pg_timeout))],
    )
    torch.manual_seed(0)
    n = args.samples
    data = TensorDataset(torch.arange(n), torch.randn(n, 8), torch.randn(n, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    found = accelerator.load_state(missing_ok=True)
    resumed = None if found is None else accelerator.checkpoint_state.iteration
    rank, world = accelerator.process_index, accelerator.num_processes
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(args.out, f"log_{args.node}_c{restart}_w{world}_r{rank}_p{os.getpid()}.jsonl")

    def log(event: str, **fields: object) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, **fields, "t": time.time()}) + "\n")
            f.flush()

    log(
        "start",
        node=args.node,
        rank=rank,
        world=world,
        restart=restart,
        pid=os.getpid(),
        resumed=resumed,
        epoch=loader.epoch,
    )
    steps = 0
    for epoch in range(loader.epoch, args.epochs):
        model.train()
        for index, x, y in loader:
            time.sleep(args.sleep)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            log("step", epoch=epoch, indices=[int(i) for i in index])
            steps += 1
            if steps % args.save_every == 0:
                log("saving")
                accelerator.save_state()
                log("saved", iteration=accelerator.checkpoint_state.iteration)
            if args.hold_after is not None and world == 1 and resumed is None and steps == args.hold_after:
                log("hold")
                deadline = time.monotonic() + args.hold_max
                while time.monotonic() < deadline:  # the joining node's rendezvous restarts this worker
                    time.sleep(0.1)
                raise SystemExit("nodes_train: held for --hold_max seconds and no node joined")
    log("done")


if __name__ == "__main__":
    main()
