"""Accelerate's public data-loading names, with Accelerate's signatures, over hasten's data module.

``hasten.data`` shards, seeds and resumes; this module only adapts: the free functions
``skip_first_batches`` and ``prepare_data_loader`` as Accelerate writes them, ``SkipBatchSampler``,
``SkipDataLoader``, ``BatchSamplerShard`` and Accelerate's constructors of ``IterableDatasetShard``
and ``SeedableRandomSampler``. Loaded on first use of one of these names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from . import _validate as v
from .data import DataLoaderShard

_LOADER_ARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "persistent_workers", "in_order",
)


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


class SkipBatchSampler(BatchSampler):
    """The batches of ``batch_sampler`` after its first ``skip_batches`` (Accelerate's class)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = v.check_number("SkipBatchSampler", "skip_batches", skip_batches, integer=True, ge=0)

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)


class SkipDataLoader(DataLoader):
    """A DataLoader whose every iteration skips its first ``skip_batches`` batches (Accelerate's class).

    The skipped batches are loaded and dropped; for a map-style dataset ``skip_first_batches``
    skips indices instead, without loading them.
    """

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any) -> None:
        if use_stateful_dataloader:
            raise ValueError("SkipDataLoader(use_stateful_dataloader=True) is not supported: hasten does not use torchdata")
        super().__init__(dataset, **kwargs)
        self.skip_batches = v.check_number("SkipDataLoader", "skip_batches", skip_batches, integer=True, ge=0)

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip_batches:
                yield batch

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A dataloader that starts after the first ``num_batches`` batches of ``dataloader``.

    A dataloader from ``prepare()`` is returned itself, its next iteration skipping the batches
    (as ``Accelerator.skip_first_batches``; its position stays resumable). Any other DataLoader
    gives a new one as in Accelerate: over a ``SkipBatchSampler`` for a map-style dataset (the
    skipped samples are never loaded), a ``SkipDataLoader`` for an iterable dataset.
    """
    num_batches = v.check_number("skip_first_batches", "num_batches", num_batches, integer=True, ge=0)
    if isinstance(dataloader, DataLoaderShard):
        dataloader.skip_first_batches(num_batches)
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches.dataloader must be a torch DataLoader, got {type(dataloader).__name__}")
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(
            dataloader.dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last, **kwargs,
        )
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    if batch_sampler is None:
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, batch_size=None, **kwargs)
    return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(batch_sampler, num_batches), **kwargs)
