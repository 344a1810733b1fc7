"""Quick start: a plain PyTorch loop made to run anywhere by five hasten lines.

Run it alone (`python examples/quickstart.py`) or on several processes
(`hasten launch --num_processes 2 examples/quickstart.py`).
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DistributedDataParallelKwargs, GradScalerKwargs

parser = argparse.ArgumentParser()
parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

torch.manual_seed(0)
x = torch.randn(1024, 16)
y = x @ torch.randn(16, 1) + 0.1 * torch.randn(1024, 1)
accelerator = Accelerator(
    mixed_precision=args.mixed_precision,
    kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=10), GradScalerKwargs(init_scale=1024.0)],
)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

for epoch in range(args.epochs):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    mean_loss = accelerator.reduce(loss.detach(), "mean")
    accelerator.print(f"epoch {epoch}: loss {mean_loss.item():.4f} on {accelerator.num_processes} process(es)")
