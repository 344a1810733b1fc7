"""Training code shared by the in-process tests and the 2-process scripts."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int = 64, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 2, generator=g) + 0.05 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def make_accelerator(mixed_precision: str):
    from hasten import Accelerator, DataLoaderConfiguration, GradScalerKwargs

    # A small initial scale: no overflow-skipped steps, whose pattern depends on the batch split.
    # The seedable sampler: the same order on 1 process and on 2 (as in Accelerate, the default
    # shuffling draws one process's order and several processes' order differently).
    return Accelerator(
        mixed_precision=mixed_precision,
        kwargs_handlers=[GradScalerKwargs(init_scale=256.0)],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def train(accelerator, batch_size: int, epochs: int = 2, lr: float = 0.05) -> tuple[dict, list[float]]:
    """Train with a shuffled loader; return the unwrapped weights and the per-step losses."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(make_data(), batch_size=batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    weights = {k: v.detach().cpu().tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return weights, losses
