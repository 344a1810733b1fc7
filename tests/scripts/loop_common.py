"""A small but complete training loop shared by the exact-resume scripts and tests.

fp16 (a GradScaler that skips and grows), gradient accumulation, dropout, a shuffled
dataloader, gradient clipping, an LR scheduler, a registered custom object, and inputs
jittered with Python's and NumPy's random generators, so that every piece of state a
checkpoint must hold changes the losses if it is not restored.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 3


class LossTracker:
    """A custom object for register_for_checkpointing: sums the (process-averaged) losses seen."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = state["total"], state["count"]


def make_accelerator(project_dir=None):
    from hasten import Accelerator, GradScalerKwargs

    # A large initial scale overflows fp16 for the first steps (skipped steps, scale backs off);
    # a short growth interval makes the scale grow again: the scaler's state matters.
    scaler = GradScalerKwargs(init_scale=2.0**16, growth_interval=3)
    return Accelerator(
        mixed_precision="fp16", gradient_accumulation_steps=2, kwargs_handlers=[scaler], project_dir=project_dir
    )


def build(accelerator):
    from hasten.utils import set_seed

    set_seed(1234)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(36, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(36, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    tracker = LossTracker()
    accelerator.register_for_checkpointing(tracker)
    return model, optimizer, loader, scheduler, tracker


def train(accelerator, *, save_at=None, save_dir=None, stop_after_save=False, resume_dir=None):
    """Train EPOCHS epochs; ``save_at=(epoch, batch)`` saves after that batch of that epoch.

    Returns one record per micro-step and the objects (for the caller to inspect).
    """
    model, optimizer, loader, scheduler, tracker = build(accelerator)
    start = 0

    def snapshot() -> dict:
        """What a checkpoint must carry over, as seen now."""
        return {
            "step": accelerator.step,
            "lr": scheduler.get_last_lr()[0],
            "scale": accelerator.scaler.get_scale(),
            "loader": {k: v for k, v in loader.state_dict().items() if k != "rng"},  # rng: tensors
            "tracker": tracker.state_dict(),
            "real_steps": optimizer.real_steps,
        }

    loaded = None
    if resume_dir is not None:
        accelerator.load_state(resume_dir)
        start = loader.epoch
        loaded = snapshot()
    records = []
    for epoch in range(start, EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                x = x + 0.01 * random.random() + 0.01 * float(np.random.randn())
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            # Registered objects are saved by the main process: keep process-wide values in them.
            tracker.add(accelerator.reduce(loss.detach(), "mean").item())
            records.append(
                {
                    "epoch": epoch,
                    "batch": loader.batches_yielded,
                    "loss": loss.item(),
                    "sync": accelerator.sync_gradients,
                    "norm": None if norm is None else float(norm),
                    "lr": scheduler.get_last_lr()[0],
                    "scale": accelerator.scaler.get_scale(),
                    "skipped": accelerator.optimizer_step_was_skipped,
                    "step": accelerator.step,
                    "real_steps": optimizer.real_steps,
                }
            )
            if save_at == (epoch, loader.batches_yielded):
                accelerator.save_state(save_dir)
                records[-1]["saved"] = snapshot()
                if stop_after_save:
                    return records, model, loaded
    return records, model, loaded


def weights(accelerator, model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
