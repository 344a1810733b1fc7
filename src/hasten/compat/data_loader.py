"""Accelerate's public data-loading names, with Accelerate's signatures, over ``hasten.data_loader``'s loaders.

``core``, ``dispatch`` and ``prepare`` (in ``hasten.data_loader``) shard, seed and resume; this module
only adapts: the free functions ``skip_first_batches`` and ``prepare_data_loader`` as Accelerate writes
them, ``SkipBatchSampler``, ``SkipDataLoader``, ``BatchSamplerShard``, ``DataLoaderStateMixin`` and
Accelerate's constructors of ``DataLoaderShard``, ``DataLoaderDispatcher``, ``IterableDatasetShard`` and
``SeedableRandomSampler``. Without an Accelerator's state passed in, they read Accelerate's global state
(``PartialState()``, ``GradientState()``), which is why they live here. ``hasten.data_loader`` exports
them (as ``accelerate.data_loader`` does), loading this module on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from hasten import _validate as v
from hasten.compat.state import GradientState, PartialState
from hasten.data_loader import core, dispatch
from hasten.data_loader.core import _loader_kwargs
from hasten.data_loader.prepare import prepare_loader

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]


def _counts_base(base: type) -> type:
    """A metaclass by which ``isinstance(x, Compat)`` holds for every instance of ``base``.

    ``Compat`` adapts hasten's ``base`` to Accelerate's signature; so the loaders, batch samplers
    and samplers that ``prepare()`` makes are instances of Accelerate's names, as in Accelerate.
    """

    def __instancecheck__(cls: type, obj: Any) -> bool:
        return isinstance(obj, base)

    return type(f"_{base.__name__}Meta", (type(base),), {"__instancecheck__": __instancecheck__})


def _one_process_batches(dataset: Any, kwargs: dict[str, Any]) -> core.ShardedBatchSampler | None:
    """The batch sampler a DataLoader would make of ``kwargs`` (taken out of them), as one process's batches."""
    batch_sampler = kwargs.pop("batch_sampler", None)
    if batch_sampler is None and not isinstance(dataset, IterableDataset):
        batch_size = kwargs.pop("batch_size", 1)
        if batch_size is not None:
            sampler = kwargs.pop("sampler", None)
            if sampler is None:
                generator = kwargs.get("generator")
                shuffle = kwargs.pop("shuffle", False)
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
            batch_sampler = BatchSampler(sampler, batch_size, kwargs.pop("drop_last", False))
        else:
            kwargs["batch_size"] = None
    if batch_sampler is not None and not isinstance(batch_sampler, core.ShardedBatchSampler):
        batch_sampler = core.ShardedBatchSampler(batch_sampler, 1, 0)  # one process: the batches as they are
    return batch_sampler


def _refuse(owner: str, use_stateful_dataloader: bool, torch_device_mesh: Any) -> None:
    if use_stateful_dataloader:
        raise ValueError(f"{owner}(use_stateful_dataloader=True) is not supported: hasten does not use torchdata")
    if torch_device_mesh is not None:
        raise ValueError(f"{owner}(torch_device_mesh=...) is not supported: hasten shards data over all processes")


class DataLoaderShard(core.DataLoaderShard, metaclass=_counts_base(core.DataLoaderShard)):
    """hasten's prepared dataloader with Accelerate's constructor.

    ``DataLoaderShard(dataset, device=None, rng_types=None, synchronized_generator=None,
    skip_batches=0, iteration=0, **dataloader_kwargs)``: the DataLoader's batches, moved to
    ``device`` when given, with the first ``skip_batches`` left out of the first iteration, and
    Accelerate's ``end_of_dataloader`` (True from the last batch on) and ``iteration`` (the
    epoch). A ``batch_sampler`` of any kind is used as it is (one process's batches).
    ``rng_types`` and ``synchronized_generator`` are accepted and need no effect: prepared
    loaders share their shuffling seed across processes. Refused: ``use_stateful_dataloader``
    and ``torch_device_mesh``. Loaders from ``prepare()`` are instances of this class's base,
    ``core.DataLoaderShard``.
    """

    def __init__(
        self,
        dataset: Any,
        device: Any = None,
        rng_types: list[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        _refuse("DataLoaderShard", use_stateful_dataloader, torch_device_mesh)
        batch_sampler = _one_process_batches(dataset, kwargs)
        super().__init__(
            dataset,
            torch.device(device) if device is not None else None,
            GradientState(),
            batch_sampler=batch_sampler,
            **kwargs,
        )
        if iteration:
            self.set_epoch(iteration)
        if skip_batches:
            self.skip_first_batches(skip_batches)


class DataLoaderDispatcher(dispatch.DataLoaderDispatcher, metaclass=_counts_base(dispatch.DataLoaderDispatcher)):
    """hasten's dispatching dataloader with Accelerate's constructor.

    ``DataLoaderDispatcher(dataset, split_batches=False, skip_batches=0, _drop_last=False,
    iteration=0, **dataloader_kwargs)``: the main process of the running processes iterates the
    DataLoader made of ``dataset`` and ``dataloader_kwargs`` and sends each process its part of
    every step, on this process's device (see ``dispatch.DataLoaderDispatcher``).
    ``_drop_last`` drops an incomplete last round. Refused: ``slice_fn`` (hasten cuts tensors
    along dim 0 on the main process and scatters the parts), ``use_stateful_dataloader``,
    ``torch_device_mesh``. Loaders that ``prepare()`` makes with ``dispatch_batches=True`` are
    instances of this class's base, ``dispatch.DataLoaderDispatcher``.
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Any = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        _refuse("DataLoaderDispatcher", use_stateful_dataloader, torch_device_mesh)
        if slice_fn is not None:
            raise ValueError(
                "DataLoaderDispatcher(slice_fn=...) is not supported: hasten cuts every tensor along dim 0 on the "
                "main process and scatters the parts"
            )
        v.check_bool("DataLoaderDispatcher", "split_batches", split_batches)
        state = PartialState()
        batch_sampler = _one_process_batches(dataset, kwargs)
        n = state.num_processes
        size = batch_sampler.batch_size if batch_sampler is not None else kwargs.get("batch_size")
        if split_batches and (size is None or size % n):
            raise ValueError(
                f"DataLoaderDispatcher(split_batches=True) needs a batch_size divisible by the number of processes "
                f"({n}), got batch_size={size}"
            )
        backend = state.backend or ""
        comm = state.device if "nccl" in str(backend) else torch.device("cpu")
        super().__init__(
            dataset,
            state.device,
            GradientState(),
            batch_sampler=batch_sampler,
            num_processes=n,
            process_index=state.process_index,
            split_batches=split_batches,
            drop_incomplete=bool(_drop_last),
            comm_device=comm,
            **kwargs,
        )
        if iteration:
            self.set_epoch(iteration)
        if skip_batches:
            self.skip_first_batches(skip_batches)


DataLoaderStateMixin = core.DataLoaderStateMixin


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


class SkipDataLoader(DataLoader, core.DataLoaderStateMixin):
    """A DataLoader whose every iteration skips its first ``skip_batches`` batches (Accelerate's class).

    The skipped batches are loaded and dropped; for a map-style dataset ``skip_first_batches``
    skips indices instead, without loading them. While iterated it is its gradient state's
    ``active_dataloader``, as in Accelerate.
    """

    base_dataloader = core._Itself()

    def __init__(
        self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any
    ) -> None:
        if use_stateful_dataloader:
            raise ValueError(
                "SkipDataLoader(use_stateful_dataloader=True) is not supported: hasten does not use torchdata"
            )
        super().__init__(dataset, **kwargs)
        self.skip_batches = v.check_number("SkipDataLoader", "skip_batches", skip_batches, integer=True, ge=0)
        self.gradient_state = GradientState()

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        try:
            for index, batch in enumerate(super().__iter__()):
                if index >= self.skip_batches:
                    yield batch
        finally:
            self.end()

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A dataloader that starts after the first ``num_batches`` batches of ``dataloader``.

    A dataloader from ``prepare()`` (or one of the classes ``DataLoaderShard`` and
    ``DataLoaderDispatcher``) is returned itself, its next iteration skipping the batches (as
    ``Accelerator.skip_first_batches``; its position and ``iteration`` stay). Any other DataLoader
    gives a new one as in Accelerate: over a ``SkipBatchSampler`` for a map-style dataset (the
    skipped samples are never loaded), a ``SkipDataLoader`` for an iterable dataset.
    """
    num_batches = v.check_number("skip_first_batches", "num_batches", num_batches, integer=True, ge=0)
    if isinstance(dataloader, core.PreparedDataLoader):  # a DataLoaderShard or DataLoaderDispatcher
        dataloader.skip_first_batches(num_batches)
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches.dataloader must be a torch DataLoader, got {type(dataloader).__name__}")
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(
            dataloader.dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    if batch_sampler is None:
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, batch_size=None, **kwargs)
    return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(batch_sampler, num_batches), **kwargs)


class SeedableRandomSampler(core.SeedableRandomSampler, metaclass=_counts_base(core.SeedableRandomSampler)):
    """hasten's seedable sampler with Accelerate's constructor.

    ``SeedableRandomSampler(data_source, replacement=False, num_samples=None, generator=None,
    data_seed=None)``: the order of epoch ``e`` is a permutation drawn from seed
    ``data_seed + e`` (``data_seed`` defaults to ``torch.initial_seed()``, with or without a
    ``generator``, as in Accelerate), so every process that builds it alike iterates alike.
    Iterating it to its end moves it to its next epoch, as Accelerate's.
    """

    def __init__(
        self,
        data_source: Any,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        if data_seed is None:
            data_seed = torch.random.initial_seed()  # as Accelerate, also when a generator is given
        super().__init__(data_source, int(data_seed), num_samples, replacement, generator)

    @property
    def initial_seed(self) -> int:
        return self.seed


class BatchSamplerShard(core.ShardedBatchSampler, metaclass=_counts_base(core.ShardedBatchSampler)):
    """hasten's sharded batch sampler with Accelerate's constructor and attributes.

    ``BatchSamplerShard(batch_sampler, num_processes=1, process_index=0, split_batches=False,
    even_batches=True)``: process ``process_index``'s batches of each global batch (see
    ``core.ShardedBatchSampler`` for how the last one is evened out: as Accelerate's).
    """

    equal_short_parts = False  # Accelerate's cut of a short split batch, exactly

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        v.check_number("BatchSamplerShard", "num_processes", num_processes, integer=True, ge=1)
        v.check_number("BatchSamplerShard", "process_index", process_index, integer=True, ge=0)
        if process_index >= num_processes:
            raise ValueError(
                f"BatchSamplerShard.process_index must be < num_processes={num_processes}, got {process_index}"
            )
        if split_batches:
            size = getattr(batch_sampler, "batch_size", None)
            if size is None:
                raise ValueError(
                    "BatchSamplerShard(split_batches=True) needs a batch_sampler with a batch_size attribute, "
                    f"got {type(batch_sampler).__name__} without one"
                )
            if size > 1 and size % num_processes:
                raise ValueError(
                    f"BatchSamplerShard(split_batches=True) needs a batch_size that is a round multiple of "
                    f"num_processes={num_processes}, got batch_size={size}"
                )
        super().__init__(
            batch_sampler, num_processes, process_index, split_batches=split_batches, even_batches=even_batches
        )

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)


class IterableDatasetShard(core.IterableDatasetShard, metaclass=_counts_base(core.IterableDatasetShard)):
    """hasten's iterable-dataset shard with Accelerate's constructor.

    ``IterableDatasetShard(dataset, batch_size=1, drop_last=False, num_processes=1,
    process_index=0, split_batches=False)``: the stream is read in global batches (``batch_size``
    per process, or ``batch_size`` in all with ``split_batches``), each process keeping its
    slice; an incomplete last global batch is dropped with ``drop_last``, else completed with
    the first samples of the stream.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        v.check_number("IterableDatasetShard", "batch_size", batch_size, integer=True, ge=1)
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise ValueError(
                "IterableDatasetShard(split_batches=True) needs a batch_size divisible by "
                f"num_processes={num_processes}, "
                f"got {batch_size}"
            )
        super().__init__(dataset, batch_size, num_processes, process_index, split_batches)
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[Any]:
        if not self.drop_last:
            yield from super().__iter__()
            return
        global_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per_rank = global_size // self.num_processes
        lo = self.process_index * per_rank
        buffer: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == global_size:
                yield from buffer[lo : lo + per_rank]
                buffer = []


class _Shape:
    """The process facts ``prepare.prepare_loader`` reads, with Accelerate's overrides."""

    def __init__(self, state: PartialState, num_processes: int, process_index: int, device: Any) -> None:
        self.num_processes = num_processes
        self.process_index = process_index
        self.device = device if device is not None else state.device
        self.use_distributed = state.use_distributed  # the seed is shared over the real group
        self.backend = state.backend


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> core.PreparedDataLoader:
    """Accelerate's ``prepare_data_loader``: ``dataloader`` for one process, as hasten prepares it.

    ``num_processes``/``process_index`` default to this process's; batches move to ``device``
    only with ``put_on_device``. ``dispatch_batches`` None means True for an iterable dataset
    with ``put_on_device``, as in Accelerate; True (which needs ``put_on_device`` and this
    process's own ``num_processes``/``process_index``) gives a ``DataLoaderDispatcher``.
    ``use_seedable_sampler`` shuffles with a ``SeedableRandomSampler`` (``data_seed`` alone does
    too, as in hasten's Accelerator). Shuffling is shared across processes without
    ``rng_types``, which has no effect. Refused: ``slice_fn_for_dispatch`` with dispatching,
    ``use_stateful_dataloader``, ``torch_device_mesh`` (one clear error each).
    """
    if use_stateful_dataloader:
        raise ValueError(
            "prepare_data_loader(use_stateful_dataloader=True) is not supported: hasten does not use torchdata"
        )
    if torch_device_mesh is not None:
        raise ValueError(
            "prepare_data_loader(torch_device_mesh=...) is not supported: hasten shards data over all processes"
        )
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader.dataloader must be a torch DataLoader, got {type(dataloader).__name__}")
    v.check_optional_bool("prepare_data_loader", "dispatch_batches", dispatch_batches)
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device) and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and slice_fn_for_dispatch is not None:
        raise ValueError(
            "prepare_data_loader(slice_fn_for_dispatch=...) is not supported: hasten cuts every tensor along dim 0 "
            "on the main process and scatters the parts"
        )
    state = PartialState()
    n = state.num_processes if num_processes is None else num_processes
    rank = state.process_index if process_index is None else process_index
    v.check_number("prepare_data_loader", "num_processes", n, integer=True, ge=1)
    if not 0 <= rank < n:
        raise ValueError(f"prepare_data_loader.process_index must be in [0, {n}), got {rank}")
    return prepare_loader(
        dataloader,
        _Shape(state, n, rank, device),
        GradientState(),
        device_placement=put_on_device,
        split_batches=split_batches,
        even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        dispatch_batches=dispatch_batches,
    )
