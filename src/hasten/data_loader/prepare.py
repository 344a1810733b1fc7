"""``prepare_loader``: a user's DataLoader made into this rank's prepared loader.

The one place that chooses between the two kinds of prepared loader (``core.DataLoaderShard``,
each process loads its share; ``dispatch.DataLoaderDispatcher``, the main process loads for all)
and builds it; ``Accelerator.prepare`` and Accelerate's ``prepare_data_loader`` (``hasten.compat.data_loader``) call it.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from hasten.data_loader.core import (
    DataLoaderShard,
    IterableDatasetShard,
    PreparedDataLoader,
    ShardedBatchSampler,
    _loader_kwargs,
    _shuffling,
    share_worker_seed,
)
from hasten.data_loader.dispatch import make_dispatcher
from hasten.distributed.state import LoopState, ProcessState


def prepare_loader(
    loader: DataLoader,
    state: ProcessState,
    gradient_state: LoopState,
    *,
    device_placement: bool = True,
    split_batches: bool = False,
    even_batches: bool = True,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    dispatch_batches: bool | None = None,
) -> PreparedDataLoader:
    """This rank's view of ``loader``: sharded, shuffled as Accelerate shuffles, moved to the device.

    ``data_seed`` implies ``use_seedable_sampler`` (in Accelerate it has no effect without it).
    ``dispatch_batches`` None resolves as in Accelerate: dispatch (``DataLoaderDispatcher``) for an
    iterable dataset whose batches are placed on the device, else each process loads its own share.
    """
    if dispatch_batches is None:
        dispatch_batches = device_placement and isinstance(loader.dataset, IterableDataset)
    if dispatch_batches:
        return make_dispatcher(
            loader, state, gradient_state, device_placement, split_batches, use_seedable_sampler, data_seed
        )
    kwargs = _loader_kwargs(loader)
    n, rank = state.num_processes, state.process_index
    device = state.device if device_placement else None

    if isinstance(loader.dataset, IterableDataset):
        batch_size = loader.batch_size
        if split_batches and (batch_size is None or batch_size % n):
            raise ValueError(
                f"split_batches=True needs a batch_size divisible by the number of processes, "
                f"got batch_size={batch_size} and num_processes={n}"
            )
        dataset = loader.dataset
        if n > 1:
            # batch_size=None: each item is a batch already, and each process takes whole items.
            dataset = IterableDatasetShard(dataset, batch_size or 1, n, rank, split_batches)
            batch_size = batch_size // n if split_batches else batch_size
        share_worker_seed(kwargs, None, state)
        return DataLoaderShard(
            dataset, device, gradient_state, batch_size=batch_size, drop_last=loader.drop_last, **kwargs
        )

    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise ValueError("prepare() needs a DataLoader that batches (batch_size=None is not supported)")
    batch_sampler = _shuffling(batch_sampler, state, use_seedable_sampler or data_seed is not None, data_seed)
    share_worker_seed(kwargs, batch_sampler, state)
    shard = ShardedBatchSampler(batch_sampler, n, rank, split_batches=split_batches, even_batches=even_batches)
    # The last rank has the fewest batches: refuse on every rank alike, so none goes on alone.
    if n > 1 and len(ShardedBatchSampler(batch_sampler, n, n - 1, split_batches, even_batches)) == 0:
        raise ValueError(
            f"the dataloader has {len(batch_sampler)} batch(es), fewer than the {n} processes: "
            "every process needs at least one batch (use a smaller batch_size or more data)"
        )
    return DataLoaderShard(loader.dataset, device, gradient_state, batch_sampler=shard, **kwargs)
