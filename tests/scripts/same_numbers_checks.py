"""Run by 2 processes: Accelerate's numbers for the scheduler, gather_for_metrics and shuffling.

Each check records what it saw (and, where the expected value comes from a rule, the reference
computed here by that rule without hasten); tests/test_same_numbers.py asserts on OUT_DIR/rank{r}.json.

usage: same_numbers_checks.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.utils import set_seed

out_dir = sys.argv[1]
results: dict = {}


def _draw(generator: torch.Generator | None = None) -> int:
    """One int64 draw, as torch's DataLoader draws its base seed and Accelerate its sampler seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


# ---------------------------------------------------------------------- 1. the LR scheduler
def scheduler_steps(split: bool, with_optimizer: bool) -> dict:
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(split_batches=split),
        gradient_accumulation_steps=2,
        step_scheduler_with_optimizer=with_optimizer,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 / (1 + e))
    # 8 batches of 2: 4 per process, or (split) 8 per process of 1 sample each.
    loader = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    seen = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen.append(
            {
                "last_epoch": scheduler.scheduler.last_epoch,
                "real_steps": optimizer.real_steps,
                "lr": scheduler.get_last_lr()[0],
            }
        )
    return {"micro_steps": seen}


def one_cycle() -> dict:
    """total_steps = 3 optimizer steps x 2 processes; 4 optimizer steps would step it 8 times."""
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=6)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=1)  # 4 per process
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    lrs, error = [], None
    try:
        for (x,) in loader:
            accelerator.backward(model(x).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    except ValueError as e:  # OneCycleLR stepped past total_steps
        error = str(e)
    # The reference: a plain OneCycleLR stepped twice per step as long as it can be (6 times).
    plain_optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.OneCycleLR(plain_optimizer, max_lr=1.0, total_steps=6)
    reference = []
    for _step in range(4):
        plain_optimizer.step()
        for _ in range(2):
            if plain.last_epoch < 6:
                plain.step()
        reference.append(plain.get_last_lr()[0])
    return {"lrs": lrs, "reference": reference, "error": error, "last_epoch": scheduler.scheduler.last_epoch}


results["scheduler"] = {
    f"split={split},with_optimizer={with_optimizer}": scheduler_steps(split, with_optimizer)
    for split in (False, True)
    for with_optimizer in (True, False)
}
results["one_cycle"] = one_cycle()


# ---------------------------------------------------------------------- 2. gather_for_metrics
class Numbers(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        yield from (torch.tensor(i) for i in range(self.n))

    def __len__(self):
        return self.n


def gathered(
    n: int, batch_size: int, split: bool = False, even: bool = True, drop_last: bool = False, iterable: bool = False
) -> dict:
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split, even_batches=even))
    data = Numbers(n) if iterable else torch.arange(n)
    loader = accelerator.prepare(DataLoader(data, batch_size=batch_size, drop_last=drop_last))
    values, per_batch, padded_total = [], [], 0
    for batch in loader:
        kept = accelerator.gather_for_metrics(batch)
        values += kept.tolist()
        per_batch.append(len(kept))
        # A metric computed per sample of a full-size batch (the transformers examples' loss.repeat(bs)).
        per_rank = batch_size // accelerator.num_processes if split else batch_size
        padded_total += accelerator.gather_for_metrics(torch.zeros(per_rank)).numel()
    return {"values": values, "per_batch": per_batch, "padded_total": padded_total}


results["gather"] = {
    "10/4": gathered(10, 4),
    "10/4 split": gathered(10, 4, split=True),
    "10/4 split uneven": gathered(10, 4, split=True, even=False),
    "5/4": gathered(5, 4),
    "13/3": gathered(13, 3),
    "12/4 drop_last": gathered(12, 4, drop_last=True),
    "10/4 iterable": gathered(10, 4, iterable=True),
}


# ---------------------------------------------------------------------- 3. shuffling and the global stream
def epochs(loader, n_epochs: int = 2) -> dict:
    """Each epoch's batches on this process, and a draw of the global stream after each epoch."""
    orders, after = [], []
    for _ in range(n_epochs):
        orders.append([b.tolist() for (b,) in loader])
        after.append(torch.rand(1).item())
    return {"orders": orders, "after": after}


def shuffled(
    config: DataLoaderConfiguration | None = None, generator_seed: int | None = None, device_specific: bool = False
) -> dict:
    set_seed(7, device_specific=device_specific)
    accelerator = Accelerator(dataloader_config=config)
    generator = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    loader = accelerator.prepare(
        DataLoader(TensorDataset(torch.arange(13)), batch_size=4, shuffle=True, generator=generator)
    )
    return epochs(loader)


def reference(sampler_generator_of_epoch, loader_generator: torch.Generator | None = None, n_epochs: int = 2) -> dict:
    """Accelerate's rule: per epoch, the loader's base seed draw, then the permutation."""
    permutations, after = [], []
    for epoch in range(n_epochs):
        _draw(loader_generator)
        # torch's own sampler: a full pass draws more than one permutation from its generator.
        permutations.append(list(RandomSampler(range(13), generator=sampler_generator_of_epoch(epoch))))
        after.append(torch.rand(1).item())
    return {"permutations": permutations, "after": after}


# Default (synchronized generator): seeded at prepare from one draw of the global stream, running on.
set_seed(7)
synced = torch.Generator().manual_seed(_draw())
results["default_reference"] = reference(lambda epoch: synced)
results["default"] = shuffled()
# use_seedable_sampler: seed torch.initial_seed() + epoch, no draw at prepare.
set_seed(7)
results["seedable_reference"] = reference(lambda epoch: torch.Generator().manual_seed(7 + epoch))
results["seedable"] = shuffled(DataLoaderConfiguration(use_seedable_sampler=True))
# data_seed alone (hasten: implies the seedable sampler).
set_seed(7)
results["data_seed_reference"] = reference(lambda epoch: torch.Generator().manual_seed(5 + epoch))
results["data_seed"] = shuffled(DataLoaderConfiguration(data_seed=5))
# The user's generator, shared by the loader (base seed) and its sampler: the global stream is untouched.
set_seed(7)
user = torch.Generator().manual_seed(9)
results["generator_reference"] = reference(lambda epoch: user, loader_generator=user)
results["generator"] = shuffled(generator_seed=9)
# Different seeds on the two processes: rank 0's generator everywhere, so the shares still partition.
results["device_specific"] = shuffled(device_specific=True)

with open(os.path.join(out_dir, f"rank{Accelerator().process_index}.json"), "w") as f:
    json.dump(results, f)
