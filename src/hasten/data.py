"""Dataloaders across processes: sharding, even last batches, device transfer, resumable position.

A prepared dataloader gives each rank its own share of every global batch. Shuffling uses
a seedable sampler (the order of epoch ``e`` is a function of the seed and ``e``) with the
same seed on every rank, so ranks never overlap and a checkpoint can resume mid-epoch on
the exact next batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from . import _validate as v
from .ops import broadcast, send_to_device
from .state import GradientState, PartialState


class SeedableRandomSampler(Sampler[int]):
    """A random permutation that depends only on ``seed`` and the epoch."""

    def __init__(self, data_source: Sized, seed: int, num_samples: int | None = None, replacement: bool = False):
        self.data_source = data_source
        self.seed = int(seed)
        self.epoch = 0
        self.replacement = replacement
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        n = len(self.data_source)
        if self.replacement:
            yield from torch.randint(n, (self.num_samples,), generator=g).tolist()
            return
        # For num_samples > n, repeat whole permutations as RandomSampler does.
        for _ in range(self.num_samples // n):
            yield from torch.randperm(n, generator=g).tolist()
        yield from torch.randperm(n, generator=g).tolist()[: self.num_samples % n]

    def __len__(self) -> int:
        return self.num_samples


class ShardedBatchSampler(Sampler[list[int]]):
    """Gives rank ``process_index`` its share of each global batch of ``batch_sampler``.

    Without ``split_batches`` a global batch is ``num_processes`` consecutive batches of the
    original sampler (one each); with it, each original batch is cut into equal parts. With
    ``even_batches`` the last global batch is completed with samples from the start of the
    epoch so that every rank gets as many batches of the same size; ``duplicates`` tells
    how many samples were added.
    """

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and self.batch_size is not None and self.batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch_size divisible by the number of processes, "
                f"got batch_size={self.batch_size} and num_processes={num_processes}"
            )
        self.duplicates = 0
        self.skip = 0  # batches to leave out at the start of the next iteration (resume)
        self._epoch_batches: list[list[int]] | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        for s in (self.sampler, self.batch_sampler):
            if s is not None and hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        self._epoch_batches = None

    def _shard(self) -> list[list[int]]:
        n, rank = self.num_processes, self.process_index
        batches = [list(b) for b in self.batch_sampler]
        self.duplicates = 0
        if n == 1:
            return batches  # one process: the loader's own batches, nothing to even out
        pool = [i for b in batches for i in b]

        def take(count: int) -> list[int]:
            self.duplicates += count
            return [pool[j % len(pool)] for j in range(count)] if pool else []

        if self.split_batches:
            out = []
            for b in batches:
                full = self.batch_size or len(b)
                if len(b) < full or len(b) % n:
                    if self.drop_last:
                        continue
                    if self.even_batches:
                        b = b + take(max(full, math.ceil(len(b) / n) * n) - len(b))
                k = math.ceil(len(b) / n)
                out.append(b[rank * k : (rank + 1) * k])
            return [b for b in out if b]

        if len(batches) % n:
            if self.drop_last:
                batches = batches[: len(batches) - len(batches) % n]
            elif self.even_batches:
                if self.batch_size is not None and batches and len(batches[-1]) < self.batch_size:
                    batches[-1] = batches[-1] + take(self.batch_size - len(batches[-1]))
                size = self.batch_size or len(batches[0])
                while len(batches) % n:
                    batches.append(take(size))
        elif self.even_batches and not self.drop_last and self.batch_size is not None and batches:
            # A short last batch in a complete round: make every rank's last batch the same size.
            short = [i for i in range(len(batches) - n, len(batches)) if len(batches[i]) < self.batch_size]
            for i in short:
                batches[i] = batches[i] + take(self.batch_size - len(batches[i]))
        return batches[rank::n]

    def epoch_batches(self) -> list[list[int]]:
        if self._epoch_batches is None:
            self._epoch_batches = self._shard()
        return self._epoch_batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches()
        self._epoch_batches = None
        return iter(batches[self.skip :] if self.skip else batches)

    def __len__(self) -> int:
        n = self.num_processes
        total = len(self.batch_sampler)
        if self.split_batches:
            if n > 1 and not self.even_batches and not self.drop_last:
                # A last batch smaller than the number of processes leaves some ranks without a part.
                return len(self.epoch_batches())
            return total
        if self.drop_last or not self.even_batches:
            return total // n if self.drop_last else math.ceil((total - self.process_index) / n)
        return math.ceil(total / n)


class IterableDatasetShard(IterableDataset):
    """Each rank's share of an iterable dataset, cut from global batches of ``batch_size * n``."""

    def __init__(self, dataset: Any, batch_size: int, num_processes: int, process_index: int, split_batches: bool):
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.duplicates = 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        n = self.num_processes
        global_size = self.batch_size if self.split_batches else self.batch_size * n
        per_rank = global_size // n
        lo, hi = self.process_index * per_rank, (self.process_index + 1) * per_rank
        first: list[Any] = []
        buffer: list[Any] = []
        self.duplicates = 0
        for item in self.dataset:
            buffer.append(item)
            if len(first) < global_size:
                first.append(item)
            if len(buffer) == global_size:
                yield from buffer[lo:hi]
                buffer = []
        if buffer:
            self.duplicates = global_size - len(buffer)
            while len(buffer) < global_size:
                buffer.extend(first[: global_size - len(buffer)])
            yield from buffer[lo:hi]


def _broadcast_seed(state: PartialState) -> int:
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if state.use_distributed:
        seed = broadcast(seed.to(state.device if state.backend == "nccl" else "cpu")).cpu()
    return int(seed.item())


_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "in_order",
)


class DataLoaderShard(DataLoader):
    """A prepared dataloader: this rank's batches, on the device, with a resumable position."""

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None,
        gradient_state: GradientState,
        batch_sampler: ShardedBatchSampler | None = None,
        **kwargs: Any,
    ) -> None:
        if batch_sampler is not None:
            super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        else:
            super().__init__(dataset, **kwargs)
        self.shard_sampler = batch_sampler
        self.device = device
        self.gradient_state = gradient_state
        self.epoch = 0
        self.batches_yielded = 0
        self._next_epoch = 0
        self._skip = 0
        # Starting an iteration draws the workers' base seed from ``self.generator``; with the
        # global generator that draw would shift dropout etc. after a mid-epoch resume. Our own
        # generator, reseeded per epoch, keeps iteration out of the global random stream.
        self._worker_seed: int | None = None
        if self.generator is None:
            self._worker_seed = int(torch.randint(0, 2**62, (1,)).item())
            self.generator = torch.Generator()

    # The position: epoch and batches already yielded in it.
    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = v.check_number("set_epoch", "epoch", epoch, integer=True, ge=0)

    def state_dict(self) -> dict[str, Any]:
        sampler = self.shard_sampler.sampler if self.shard_sampler is not None else None
        return {
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            "next_epoch": self._next_epoch,
            "seed": getattr(sampler, "seed", None),
            "worker_seed": self._worker_seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.shard_sampler.sampler if self.shard_sampler is not None else None
        if state.get("seed") is not None and isinstance(sampler, SeedableRandomSampler):
            sampler.seed = int(state["seed"])
        if state.get("worker_seed") is not None and self._worker_seed is not None:
            self._worker_seed = int(state["worker_seed"])
        # Restore the position itself too (saving again before iterating saves the same place):
        # afterwards ``epoch`` is the epoch the next iteration runs, ``batches_yielded`` its skip.
        try:
            total: float = len(self)
        except TypeError:  # an iterable dataset without a length: resume after what was seen
            total = math.inf
        if state["batches_yielded"] and state["batches_yielded"] < total:
            self._next_epoch = self.epoch = state["epoch"]
            self._skip = self.batches_yielded = state["batches_yielded"]
        else:
            self._next_epoch = self.epoch = state["next_epoch"]
            self._skip = self.batches_yielded = 0

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next iteration start after its first ``num_batches`` batches."""
        self._skip = v.check_number("skip_first_batches", "num_batches", num_batches, integer=True, ge=0)

    def _set_epoch_everywhere(self, epoch: int) -> None:
        if self.shard_sampler is not None:
            self.shard_sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.epoch = self._next_epoch
        self._next_epoch += 1
        self._set_epoch_everywhere(self.epoch)
        skip, self._skip = self._skip, 0
        self.batches_yielded = skip
        if self._worker_seed is not None:
            self.generator.manual_seed(self._worker_seed + self.epoch)
        state = self.gradient_state
        # A loop inside another one's batch (evaluation during the last training batch) hands
        # the outer loop its end-of-data facts back when it finishes.
        outer = (state.end_of_dataloader, state.remainder)
        state.end_of_dataloader = False
        move = self.device is not None and self.device.type != "cpu"
        non_blocking = bool(self.pin_memory)
        device = self.device

        if self.shard_sampler is not None and skip:
            # Index-level skip: the skipped batches are never loaded. The sampler is iterated
            # when the iterator is made or reset (persistent workers too), so set it around that.
            self.shard_sampler.skip = skip
            try:
                base = super().__iter__()
            finally:
                self.shard_sampler.skip = 0
        else:
            base = super().__iter__()
            if skip:
                for _ in range(skip):
                    next(base, None)

        # Look one batch ahead so the last batch is known before it is used.
        try:
            current = next(base, _END)
            while current is not _END:
                upcoming = next(base, _END)
                if upcoming is _END:
                    state.end_of_dataloader = True
                    state.remainder = self._duplicates()
                self.batches_yielded += 1
                yield send_to_device(current, device, non_blocking) if move else current
                current = upcoming
        finally:  # also when the loop is left early (break), so later steps do not force a sync
            state.end_of_dataloader, state.remainder = outer

    def _duplicates(self) -> int:
        if self.shard_sampler is not None:
            return self.shard_sampler.duplicates
        return getattr(self.dataset, "duplicates", 0)


_END = object()


def prepare_data_loader(
    loader: DataLoader,
    state: PartialState,
    gradient_state: GradientState,
    *,
    device_placement: bool = True,
    split_batches: bool = False,
    even_batches: bool = True,
) -> DataLoaderShard:
    """This rank's view of ``loader``: sharded, seedably shuffled, moved to the device."""
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    n, rank = state.num_processes, state.process_index
    device = state.device if device_placement else None

    if isinstance(loader.dataset, IterableDataset):
        batch_size = loader.batch_size
        if batch_size is None:
            raise ValueError("prepare() needs a DataLoader with a batch_size for an IterableDataset")
        if split_batches and batch_size % n:
            raise ValueError(
                f"split_batches=True needs a batch_size divisible by the number of processes, "
                f"got batch_size={batch_size} and num_processes={n}"
            )
        dataset = loader.dataset
        if n > 1:
            dataset = IterableDatasetShard(dataset, batch_size, n, rank, split_batches)
            batch_size = batch_size // n if split_batches else batch_size
        return DataLoaderShard(
            dataset, device, gradient_state, batch_size=batch_size, drop_last=loader.drop_last, **kwargs
        )

    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise ValueError("prepare() needs a DataLoader that batches (batch_size=None is not supported)")
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, RandomSampler) and type(batch_sampler) is BatchSampler:
        # Same order on every rank and a reproducible order per epoch.
        seedable = SeedableRandomSampler(
            sampler.data_source, _broadcast_seed(state), sampler._num_samples, sampler.replacement
        )
        batch_sampler = BatchSampler(seedable, batch_sampler.batch_size, batch_sampler.drop_last)
    elif isinstance(sampler, RandomSampler) and n > 1:
        # A custom batch sampler over a random sampler: seed that sampler's generator alike everywhere.
        generator = torch.Generator()
        generator.manual_seed(_broadcast_seed(state))
        sampler.generator = generator
    shard = ShardedBatchSampler(batch_sampler, n, rank, split_batches=split_batches, even_batches=even_batches)
    # The last rank has the fewest batches: refuse on every rank alike, so none goes on alone.
    if n > 1 and len(ShardedBatchSampler(batch_sampler, n, n - 1, split_batches, even_batches)) == 0:
        raise ValueError(
            f"the dataloader has {len(batch_sampler)} batch(es), fewer than the {n} processes: "
            "every process needs at least one batch (use a smaller batch_size or more data)"
        )
    return DataLoaderShard(loader.dataset, device, gradient_state, batch_sampler=shard, **kwargs)


def check_loader_state(state: Any, where: str) -> None:
    """Raise unless ``state`` is a dataloader position ``DataLoaderShard.load_state_dict`` takes."""
    if not isinstance(state, dict):
        raise ValueError(f"{where}: a dataloader position must be a dict, got {type(state).__name__}")
    for key in ("epoch", "batches_yielded", "next_epoch"):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: the dataloader position's {key!r} must be an integer >= 0, got {value!r}")
    for key in ("seed", "worker_seed"):
        value = state.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{where}: the dataloader position's {key!r} must be an integer or None, got {value!r}")
