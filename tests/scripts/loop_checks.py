"""Training-loop checks on 2 processes, one launch: loop_checks.py OUT

Each process writes OUT/rank{r}.json; tests/test_loop.py asserts on them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator


def counting_hook(state: dict, bucket):
    """A DDP comm hook that counts the all-reduces and then does the usual one."""
    state["allreduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def same_everywhere(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


def accumulation(res: dict) -> None:
    """Steps 4: all-reduce only on the 4th micro-step and on the last batch (end of dataloader)."""
    accelerator = Accelerator(gradient_accumulation_steps=4)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 3, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)  # 12 batches: 6 per process
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = {"allreduces": 0}
    model.register_comm_hook(counter, counting_hook)
    steps = []
    seen_x, seen_y = [], []
    reference = None
    for bx, by in loader:
        before = counter["allreduces"]
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(bx), by)
            accelerator.backward(loss)
            grad = flat_grad(model)
            seen_x.append(bx)
            seen_y.append(by)
            if accelerator.sync_gradients and reference is None:
                # One big batch: every sample of this cycle, on all processes, in one plain model.
                big_x = accelerator.gather(torch.cat(seen_x))
                big_y = accelerator.gather(torch.cat(seen_y))
                plain = torch.nn.Linear(4, 3)
                plain.load_state_dict(accelerator.unwrap_model(model).state_dict())
                torch.nn.functional.mse_loss(plain(big_x), big_y).backward()
                reference = (grad - flat_grad(plain)).abs().max().item()
            weights_before = accelerator.unwrap_model(model).weight.detach().clone()
            optimizer.step()
            changed = not torch.equal(weights_before, accelerator.unwrap_model(model).weight)
            optimizer.zero_grad()
        steps.append(
            {
                "sync": accelerator.sync_gradients,
                "end_of_dataloader": accelerator.gradient_state.end_of_dataloader,
                "allreduces": counter["allreduces"] - before,
                "grads_equal_across_ranks": same_everywhere(grad.tolist()),
                "weights_changed": changed,
            }
        )
        if accelerator.sync_gradients:
            seen_x, seen_y = [], []
    res["accumulation"] = {"steps": steps, "big_batch_max_diff": reference, "step": accelerator.step}

    # no_sync by hand: no all-reduce inside, one outside.
    before = counter["allreduces"]
    bx, by = x[:2], y[:2]
    with accelerator.no_sync(model):
        torch.nn.functional.mse_loss(model(bx), by).backward()
    inside = counter["allreduces"] - before
    torch.nn.functional.mse_loss(model(bx), by).backward()
    res["no_sync"] = {"inside": inside, "after": counter["allreduces"] - before - inside}


def clipping(res: dict) -> None:
    """fp16 + DDP: clip_grad_norm_ unscales once, returns the all-reduced total norm."""
    accelerator = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(10 + accelerator.process_index)  # different data per process
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    scale = accelerator.scaler.get_scale()
    scaled = flat_grad(model).clone()
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6)
    unscaled = flat_grad(model).clone()
    again = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6)
    clipped = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.01)
    after_clip = torch.linalg.vector_norm(flat_grad(model)).item()
    optimizer.step()  # must not unscale a second time (GradScaler would raise)
    res["clipping"] = {
        "scale": scale,
        "norm": norm.item(),
        "manual_norm": torch.linalg.vector_norm(unscaled).item(),
        "unscale_error": (scaled / scale - unscaled).abs().max().item(),
        "again": again.item(),
        "clipped_returned": clipped.item(),
        "after_clip": after_clip,
        "norm_same_everywhere": same_everywhere(norm.item()),
        "skipped": accelerator.optimizer_step_was_skipped,
    }


def scheduler(res: dict) -> None:
    """Scheduler steps on real optimizer steps only (not micro-steps), once per process on each (Accelerate)."""
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=2)  # 4 per process
    model, optimizer, loader, sched = accelerator.prepare(model, optimizer, loader, sched)
    lrs = []
    for bx, by in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(bx), by))
            optimizer.step()
            sched.step()
            optimizer.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    res["scheduler"] = {"lrs": lrs, "last_epoch": sched.last_epoch, "step": accelerator.step}


def metrics_and_processes(res: dict, out: str) -> None:
    accelerator = Accelerator()
    rank = accelerator.process_index
    # gather_for_metrics: 10 samples, batch 4, 2 processes -> 3 global batches evened out to 4.
    data = TensorDataset(torch.arange(10))
    loader = accelerator.prepare(DataLoader(data, batch_size=4))
    gathered, objects, per_batch = [], [], []
    for (batch,) in loader:
        g = accelerator.gather_for_metrics(batch)
        per_batch.append(len(g))
        gathered += g.tolist()
        objects += accelerator.gather_for_metrics(batch.tolist(), use_gather_object=True)
    res["gather_for_metrics"] = {"tensors": gathered, "objects": objects, "per_batch": per_batch}
    # a loss that still requires grad (Accelerate's gradient_accumulation_for_autoregressive_models example)
    w = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    losses = accelerator.gather_for_metrics((w * 2).sum().repeat(3))
    res["gather_requires_grad"] = {"values": losses.tolist(), "requires_grad": losses.requires_grad}
    # pad_across_processes: lengths 1 and 2.
    t = torch.full((rank + 1, 2), rank + 1)
    res["pad"] = {
        "last": accelerator.pad_across_processes(t, dim=0, pad_index=-1).tolist(),
        "first": accelerator.pad_across_processes(t, dim=0, pad_index=-1, pad_first=True).tolist(),
        "gathered": accelerator.gather(accelerator.pad_across_processes(t, dim=0)).tolist(),
    }
    # split_between_processes
    split = {}
    with accelerator.split_between_processes(list(range(5))) as part:
        split["list"] = part
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as part:
        split["padded"] = part
    with accelerator.split_between_processes({"a": torch.arange(4), "b": ["x", "y", "z", "w"]}) as part:
        split["dict"] = {"a": part["a"].tolist(), "b": part["b"]}
    res["split"] = split
    # main_process_first: the main process runs the block first, then the others.
    marker = os.path.join(out, "main_first.txt")
    with accelerator.main_process_first():
        seen = os.path.exists(marker)
        if accelerator.is_main_process:
            with open(marker, "w") as f:
                f.write("main")
    res["main_process_first_saw_marker"] = seen

    @accelerator.on_main_process
    def who() -> int:
        return accelerator.process_index

    res["on_main_process"] = who()
    # skip_first_batches: 8 samples, batch 2 -> process r gets global batches r and r+2.
    skip_loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    skipped = [b.tolist() for (b,) in accelerator.skip_first_batches(skip_loader, 1)]
    full = [b.tolist() for (b,) in skip_loader]
    res["skip_first_batches"] = {"skipped": skipped, "next_epoch": full}


def local_sgd(res: dict) -> None:
    """LocalSGD on DDP against a hand-written reference: each process's copy trained on its own
    batches, averaged every 2 steps and at the end."""
    from hasten.training.local_sgd import LocalSGD

    accelerator = Accelerator()
    rank, n = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    copies = [torch.nn.Linear(4, 2) for _ in range(n)]
    for c in copies:
        c.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(5)
    data = [[(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(5)] for _ in range(n)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    reduced_inside = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as sgd:
        for x, y in data[rank]:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            reduced_inside.append(model.module.weight.grad.clone())
            opt.step()
            opt.zero_grad()
            sgd.step()
    ref_opts = [torch.optim.SGD(c.parameters(), lr=0.1) for c in copies]

    def average():
        with torch.no_grad():
            for ps in zip(*(c.parameters() for c in copies)):
                mean = sum(p.detach().clone() for p in ps) / n
                for p in ps:
                    p.copy_(mean)

    for step in range(5):
        for c, o, d in zip(copies, ref_opts, data):
            torch.nn.functional.mse_loss(c(d[step][0]), d[step][1]).backward()
            o.step()
            o.zero_grad()
        if (step + 1) % 2 == 0:
            average()
    average()  # leaving the block
    local = torch.nn.Linear(4, 2)
    local.load_state_dict(copies[rank].state_dict())
    torch.nn.functional.mse_loss(local(data[rank][0][0]), data[rank][0][1]).backward()
    res["local_sgd"] = {
        "diff": max((a - b).abs().max().item() for a, b in zip(model.module.parameters(), copies[0].parameters())),
        "num_steps": sgd.num_steps,
        "grads_stay_local": bool(torch.allclose(reduced_inside[0], _first_local_grad(data[rank][0], copies, rank))),
    }


def _first_local_grad(batch, copies, rank):
    torch.manual_seed(0)
    fresh = torch.nn.Linear(4, 2)
    torch.nn.functional.mse_loss(fresh(batch[0]), batch[1]).backward()
    return fresh.weight.grad


def main() -> None:
    out = sys.argv[1]
    res: dict = {}
    accumulation(res)
    clipping(res)
    scheduler(res)
    metrics_and_processes(res, out)
    local_sgd(res)
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    Accelerator().end_training()


if __name__ == "__main__":
    main()
