"""Dataloaders across processes (the loaders themselves; ``prepare.py`` makes them): sharding, even last batches,
device transfer, resumable position.

A prepared dataloader gives each rank its own share of every global batch. Shuffling draws
its random numbers as Accelerate does, so a seed gives Accelerate's order and leaves the
global random stream where Accelerate leaves it:

- one process: as plain PyTorch (the sampler and the workers' base seed draw from the global
  generator when each epoch starts);
- several processes: a shuffling sampler without a generator gets one at ``prepare``, seeded
  from the global generator (rank 0's seed everywhere), and its stream runs on epoch after epoch;
- several processes that share one batch (pipeline, tensor, context parallelism: a
  ``DataParallelView`` whose ``shares_batches`` is True), even with a single data group: the same,
  whatever the user seeded, and the workers' base seed is drawn from that shared generator too
  (or from one seeded by rank 0 where the order is not shuffled), so random transforms in the
  workers agree across the group;
- ``use_seedable_sampler`` or ``data_seed``: the order of epoch ``e`` comes from a generator
  seeded with ``data_seed`` (else ``torch.initial_seed()``) ``+ e``.

For an exact mid-epoch resume each epoch notes the generator states it started from; a
resumed epoch draws its order (and base seed) again from those, then puts the global
generator back as the checkpoint left it.

Every rank draws the same global order (the batches of the original batch sampler), and
rank ``r`` of ``n`` takes its share of each global batch. The position is therefore also
saved as a global one: the number of the original sampler's batches consumed in the epoch
(``global_batches``). A checkpoint saved by ``n`` processes resumes at ``m``: the epoch's
order is drawn again from the saved generator states, its first ``global_batches`` batches
are left out and the rest is shared among the ``m`` ranks, so every sample of the epoch is
seen once (plus the padding ``even_batches`` adds at the end).

With ``dispatch_batches`` a ``DataLoaderDispatcher`` (``dispatch.py`` of this package) reads the original loader on
the main
process only and sends every rank its part of each step; its position counts the same
original batches, so it saves, resumes and changes size the same way (a stream included).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from hasten import _validate as v
from hasten.data_loader.position import _needs_global_resume, check_global_resume, global_position
from hasten.distributed.ops import broadcast_object_list, send_to_device
from hasten.distributed.state import LoopState, ProcessState


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order for epoch ``e`` comes from a generator seeded with ``seed + e``."""

    def __init__(
        self,
        data_source: Sized,
        seed: int,
        num_samples: int | None = None,
        replacement: bool = False,
        generator: torch.Generator | None = None,
    ):
        # Its own generator when none is given (made now, not at the first epoch as Accelerate
        # does: no draw either way, and the checkpointed list of generators stays the same).
        generator = generator if generator is not None else torch.Generator()
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # Seeded when the order is drawn (after the loader drew its base seed, maybe from this
        # same generator when the user gave the loader one), as Accelerate's sampler does.
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        # As Accelerate's: a plain DataLoader over it draws the next epoch's order next time. A
        # prepared loader sets the epoch itself before each epoch (and keeps it while drawing).
        self.epoch += 1


class ShardedBatchSampler(Sampler[list[int]]):
    """Gives rank ``process_index`` its share of each global batch of ``batch_sampler``.

    Without ``split_batches`` a global batch is ``num_processes`` consecutive batches of the
    original sampler (one each); with it, each original batch is cut into parts of
    ``batch_size / num_processes`` samples. The end of the epoch is evened out by Accelerate's
    rule, so the batches are Accelerate's: with ``even_batches`` the last round is completed
    with the first samples of the epoch, taken in order and cycled (a short last batch first,
    then whole batches for the ranks that have none; batches of varying size, without a
    ``batch_size``, get whole batches from the start of the epoch); a short split batch is
    completed before it is cut. Without ``even_batches`` the ranks take what there is (a short
    split batch gives parts to the first ranks only). ``duplicates`` tells how many samples
    were added, ``remainder`` how many samples of the last global batch are real when that
    batch is short (Accelerate's ``remainder``; 0 when it is full).

    One difference from Accelerate, in prepared loaders only (``equal_short_parts``): without
    ``even_batches`` a short split batch is cut into equal parts, so every rank gets a part when
    the batch has a sample per rank (Accelerate's cut leaves the last ranks without a batch, and
    their next collective, a DDP backward or a gather, waits forever). The public
    ``BatchSamplerShard`` cuts as Accelerate does.

    An epoch's batches are drawn when its first batch is asked for (after the DataLoader drew
    its base seed, as with torch's own samplers). ``rng_state`` is the global generator's state
    just before; a resumed epoch sets ``replay_rng`` to draw them again from that state.
    """

    equal_short_parts = True

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
        self.remainder = 0
        self.skip = 0  # batches to leave out at the start of the next iteration (resume)
        self.rng_state: torch.Tensor | None = None
        self.replay_rng: torch.Tensor | None = None
        # A resumed epoch at another number of processes: the original batches to leave out, and
        # the state the sampler's generator drew the order from (None: it drew from the global one).
        self.global_skip = 0
        self.replay_sampler: tuple[torch.Tensor | None] | None = None
        # The first ``head_size`` indices of the epoch (before any skip): a dispatching loader
        # completes its last batch with those samples.
        self.head_size = 0
        self.head: list[int] = []
        self._epoch_batches: list[list[int]] | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        for s in (self.sampler, self.batch_sampler):
            if s is not None and hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        self._epoch_batches = None

    def _draw(self) -> list[list[int]]:
        """The original sampler's batches for the epoch; a seedable sampler keeps its epoch (drawing
        the whole epoch at once is this class's way, not the end of an epoch)."""
        sampler = self.sampler
        epoch = sampler.epoch if isinstance(sampler, SeedableRandomSampler) else None
        batches = [list(b) for b in self.batch_sampler]
        if epoch is not None:
            sampler.epoch = epoch
        return batches

    def _shard(self, global_skip: int = 0) -> list[list[int]]:
        n = self.num_processes
        batches = self._draw()
        if self.head_size:
            head: list[int] = []
            for b in batches:
                head += b
                if len(head) >= self.head_size:
                    break
            self.head = head[: self.head_size]
        # Accelerate's source of padding: the first batch (split) or the first round (no split).
        first = batches[:1] if self.split_batches else batches[:n]
        batches = batches[global_skip:] if global_skip else batches
        self.duplicates = 0
        if n == 1:  # one process: the loader's own batches, nothing to even out
            last = len(batches[-1]) if batches else 0
            self.remainder = last if self.batch_size is not None and last < self.batch_size else 0
            return batches
        if self.split_batches:
            return self._split(batches, [i for b in first for i in b])
        return self._whole(batches, first)

    def _split(self, batches: list[list[int]], pool: list[int]) -> list[list[int]]:
        n, rank = self.num_processes, self.process_index
        size = self.batch_size
        out = []
        real = padded = 0
        for b in batches:
            full = size if size is not None else math.ceil(len(b) / n) * n
            part = full // n
            pad = 0
            if len(b) < full:
                if self.drop_last:
                    continue
                if self.even_batches:
                    pad = full - len(b)
            real, padded = len(b), pad
            if pad:
                b = b + [pool[j % len(pool)] for j in range(pad)]
                self.duplicates += pad
            elif len(b) < full and self.equal_short_parts:
                part = math.ceil(len(b) / n)
            mine = b[rank * part : (rank + 1) * part]
            if mine:
                out.append(mine)
        self._set_remainder(real, padded, size)
        return out

    def _whole(self, batches: list[list[int]], first: list[list[int]]) -> list[list[int]]:
        n, rank = self.num_processes, self.process_index
        size = self.batch_size
        tail = len(batches) % n
        last_short = size is not None and bool(batches) and len(batches[-1]) < size
        if self.drop_last and tail:
            batches = batches[: len(batches) - tail]
        elif self.even_batches and (tail or last_short) and first:
            cursor = 0
            if size is None:  # batches of any size: whole batches from the start of the epoch, cycled
                while len(batches) % n:
                    extra = first[cursor % len(first)]
                    batches.append(list(extra))
                    self.duplicates += len(extra)
                    cursor += 1
            else:  # samples from the start of the epoch, in order and cycled: the short batch first
                pool = [i for b in first for i in b]

                def take(count: int) -> list[int]:
                    nonlocal cursor
                    taken = [pool[(cursor + j) % len(pool)] for j in range(count)]
                    cursor += count
                    self.duplicates += count
                    return taken

                if last_short:
                    batches[-1] = batches[-1] + take(size - len(batches[-1]))
                while len(batches) % n:
                    batches.append(take(size))
        # Every duplicate is in the last round: the last global batch.
        last_round = batches[(len(batches) - 1) // n * n :] if batches else []
        total = sum(len(b) for b in last_round)
        global_size = None if size is None else size * n
        self._set_remainder(total - self.duplicates, self.duplicates, global_size)
        return batches[rank::n]

    def _set_remainder(self, real: int, padded: int, global_size: int | None) -> None:
        """The real samples of the last global batch when it is short, else 0 (nothing to drop)."""
        short = real < global_size if global_size is not None else padded > 0
        self.remainder = real if short else 0

    def epoch_batches(self) -> list[list[int]]:
        if self._epoch_batches is None:
            replay, self.replay_rng = self.replay_rng, None
            skip, self.global_skip = self.global_skip, 0
            sampler_state, self.replay_sampler = self.replay_sampler, None
            self.rng_state = replay if replay is not None else torch.get_rng_state()
            with global_rng(replay), self._sampler_drawing_from(sampler_state):
                self._epoch_batches = self._shard(skip)
        return self._epoch_batches

    @contextmanager
    def _sampler_drawing_from(self, saved: tuple[torch.Tensor | None] | None) -> Iterator[None]:
        """Let the sampler draw the order as the saving run's did: from a generator in the saved
        state, or (saved ``None``) from the global generator, whatever it has here."""
        sampler = self.sampler
        if saved is None or not hasattr(sampler, "generator"):
            yield
            return
        own = sampler.generator
        (state,) = saved
        if state is None:
            sampler.generator = None
        elif own is None:
            sampler.generator = torch.Generator()
            sampler.generator.set_state(state)
        else:
            own.set_state(state)
        try:
            yield
        finally:
            sampler.generator = own

    def __iter__(self) -> Iterator[list[int]]:
        return self._iterate(self.skip)

    def _iterate(self, skip: int) -> Iterator[list[int]]:
        # A generator: the batches are drawn at the first next(), not when the iterator is made.
        # They stay until the next set_epoch, so len() during the epoch draws nothing.
        batches = self.epoch_batches()
        yield from (batches[skip:] if skip else batches)

    def _count_batches(self) -> int:
        """This rank's number of batches in the epoch, leaving every generator as it was."""
        if self._epoch_batches is not None:
            return len(self._epoch_batches)
        generator = getattr(self.sampler, "generator", None)
        saved = (self.duplicates, self.remainder, generator.get_state() if generator is not None else None)
        with global_rng(torch.get_rng_state()):
            count = len(self._shard())
        self.duplicates, self.remainder = saved[0], saved[1]
        if generator is not None:
            generator.set_state(saved[2])
        return count

    def __len__(self) -> int:
        n = self.num_processes
        total = len(self.batch_sampler)
        if self.split_batches:
            if n > 1 and not self.even_batches and not self.drop_last:
                # A last batch smaller than the number of processes leaves some ranks without a part.
                return self._count_batches()
            return total
        if self.drop_last or not self.even_batches:
            return total // n if self.drop_last else math.ceil((total - self.process_index) / n)
        return math.ceil(total / n)


@contextmanager
def global_rng(state: torch.Tensor | None) -> Iterator[None]:
    """Run the block with torch's global CPU generator in ``state`` (None: as it is), then put it back."""
    if state is None:
        yield
        return
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(saved)


class IterableDatasetShard(IterableDataset):
    """Each rank's share of an iterable dataset, cut from global batches of ``batch_size * n``."""

    def __init__(self, dataset: Any, batch_size: int, num_processes: int, process_index: int, split_batches: bool):
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.duplicates = 0
        self.remainder = 0  # real samples of the last global batch when it was completed, else 0

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
        self.duplicates = self.remainder = 0
        for item in self.dataset:
            buffer.append(item)
            if len(first) < global_size:
                first.append(item)
            if len(buffer) == global_size:
                yield from buffer[lo:hi]
                buffer = []
        if buffer:
            self.duplicates, self.remainder = global_size - len(buffer), len(buffer)
            while len(buffer) < global_size:
                buffer.extend(first[: global_size - len(buffer)])
            yield from buffer[lo:hi]


def _new_seed() -> int:
    """A seed drawn from torch's global generator, with the very draw Accelerate makes."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _from_main_process(state: ProcessState, value: Any) -> Any:
    """Rank 0's ``value`` on every process (a picklable object)."""
    if not state.use_distributed:
        return value
    return broadcast_object_list([value])[0]


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


class DataLoaderStateMixin:
    """Accelerate's mixin of prepared dataloaders: each knows where its own iteration stands.

    ``end_of_dataloader`` is True from the moment the loader hands out its last batch of the
    epoch (until its next iteration starts), ``remainder`` is then how many samples of the last
    global batch are real (-1 before). While it is iterated the loader is its gradient state's
    ``active_dataloader`` (``begin``/``end``). ``hasten``'s prepared loaders
    (``DataLoaderShard``, ``DataLoaderDispatcher``) are instances of it.
    """

    end_of_dataloader = False
    remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """This loader's iteration starts: it becomes the gradient state's active dataloader."""
        self.reset()
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """This loader's iteration ended or was left."""
        self.gradient_state._remove_dataloader(self)


class _Itself:
    """``loader.base_dataloader``: Accelerate's loaders wrap a DataLoader, hasten's are one."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(f"base_dataloader is an attribute of {owner.__name__} objects, not of the class")
        return obj


class PreparedDataLoader(DataLoader, DataLoaderStateMixin):
    """What ``prepare`` returns for a DataLoader: this rank's batches, on the device, with a
    resumable position. ``DataLoaderShard`` (each process loads its own share) and
    ``DataLoaderDispatcher`` (the main process loads, each process receives its part) are the two
    kinds; everything about the position, the epoch and resuming is common and lives here.
    """

    base_dataloader = _Itself()
    # True for a DataLoaderDispatcher: the main process reads the loader, the others receive their parts.
    _main_process_reads = False

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None,
        gradient_state: LoopState,
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
        # What the current epoch drew from (see the module's docstring): the global generator's
        # state when its iterator was made, and the states of the generators of its own.
        self._epoch_rng: torch.Tensor | None = None
        self._epoch_generators: list[torch.Tensor] | None = None
        self._replay: dict[str, Any] | None = None  # set by load_state_dict for a mid-epoch resume
        self._epoch_sampler_generator: torch.Tensor | None = None
        # The global position is _offset + (batches_yielded - _base) * (original batches per batch):
        # a resume at another number of processes starts the epoch at a global offset.
        self._offset = 0
        self._base = 0
        self._epoch_done = False  # the current epoch's iteration ran to its end
        self._iterating = 0  # iterations in progress (the epoch number is then `epoch`)

    @property
    def split_batches(self) -> bool:
        return bool(getattr(self.shard_sampler or self.dataset, "split_batches", False))

    @property
    def total_batch_size(self) -> int | None:
        """Samples one step takes over all processes (Accelerate's name; transformers' Trainer tests read
        it): the batch size, times the processes unless batches are split (then it is already global)."""
        size = self._batch_size()
        return None if size is None else size * (1 if self.split_batches else self._num_processes())

    @property
    def total_dataset_length(self) -> int:
        """The samples of the whole dataset (Accelerate's name), not of this process's share."""
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return len(dataset)

    @property
    def iteration(self) -> int:
        """Accelerate's epoch counter: the epoch being iterated, else the one the next iteration runs."""
        return self.epoch if self._iterating else self._next_epoch

    @iteration.setter
    def iteration(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def _num_processes(self) -> int:
        if self.shard_sampler is not None:
            return self.shard_sampler.num_processes
        return self.dataset.num_processes if isinstance(self.dataset, IterableDatasetShard) else 1

    def _per_batch(self) -> int:
        """How many batches of the original sampler (or global batches of an iterable) one batch of this rank
        advances."""
        if self.shard_sampler is not None and self.shard_sampler.split_batches:
            return 1
        if isinstance(self.dataset, IterableDatasetShard) and self.dataset.split_batches:
            return 1
        return self._num_processes()

    def _batch_size(self) -> int | None:
        if self.shard_sampler is not None:
            return self.shard_sampler.batch_size
        return self.dataset.batch_size if isinstance(self.dataset, IterableDatasetShard) else self.batch_size

    def _sampler_generator_state(self) -> torch.Tensor | None:
        generator = getattr(getattr(self.shard_sampler, "sampler", None), "generator", None)
        return generator.get_state() if isinstance(generator, torch.Generator) else None

    def _generators(self) -> list[torch.Generator]:
        """The loader's and the sampler's own generators (not the global one), each once."""
        sampler = getattr(self.shard_sampler, "sampler", None)
        found: list[torch.Generator] = []
        for g in (self.generator, getattr(sampler, "generator", None)):
            if isinstance(g, torch.Generator) and all(g is not other for other in found):
                found.append(g)
        return found

    def _set_generators(self, states: list[torch.Tensor] | None) -> None:
        if states is None:  # nothing saved (an epoch not started yet)
            return
        generators = self._generators()
        if len(states) != len(generators):
            raise ValueError(
                f"the saved dataloader state holds {len(states)} generator state(s) but this dataloader has "
                f"{len(generators)} generator(s) of its own (DataLoader(generator=...), its sampler's generator): "
                "prepare the same dataloader as the run that saved it"
            )
        for g, st in zip(generators, states):
            g.set_state(st)

    # The position: epoch and batches already yielded in it.
    def set_epoch(self, epoch: int) -> None:
        """The next iteration runs epoch ``epoch``; the sampler, batch sampler or dataset hears it at once."""
        self._next_epoch = v.check_number("set_epoch", "epoch", epoch, integer=True, ge=0)
        self._set_epoch_everywhere(self._next_epoch)

    def state_dict(self) -> dict[str, Any]:
        sampler = self.shard_sampler.sampler if self.shard_sampler is not None else None
        if self._replay is not None:  # loaded, not iterated yet: the same place again
            rng = {k: self._replay[k] for k in _REPLAY_KEYS}
        else:
            rng = {
                "iterator": self._epoch_rng,
                "batches": self.shard_sampler.rng_state if self.shard_sampler is not None else None,
                "generators_at_start": self._epoch_generators,
                "sampler_generator_at_start": self._epoch_sampler_generator,
            }
        try:
            total: float = len(self)
        except TypeError:
            total = math.inf
        return {
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            "next_epoch": self._next_epoch,
            "seed": getattr(sampler, "seed", None),
            "rng": {**rng, "generators": [g.get_state() for g in self._generators()]},
            # The global position, for a resume at another number of processes.
            "num_processes": self._num_processes(),
            "batch_size": self._batch_size(),
            "split_batches": self.split_batches,
            "global_batches": self._offset + (self.batches_yielded - self._base) * self._per_batch(),
            "global_offset": self._offset,
            "in_epoch": self._replay is not None or (not self._epoch_done and 0 < self.batches_yielded < total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.shard_sampler.sampler if self.shard_sampler is not None else None
        if state.get("seed") is not None and isinstance(sampler, SeedableRandomSampler):
            sampler.seed = int(state["seed"])
        rng = state.get("rng") or {}
        self._offset = self._base = 0
        self._epoch_done = False
        if _needs_global_resume(self, state):
            self._load_global(state, rng)
            return
        # Restore the position itself too (saving again before iterating saves the same place):
        # afterwards ``epoch`` is the epoch the next iteration runs, ``batches_yielded`` its skip.
        try:
            total: float = len(self)
        except TypeError:  # an iterable dataset without a length: resume after what was seen
            total = math.inf
        if state["batches_yielded"] and state["batches_yielded"] < total:
            self._next_epoch = self.epoch = state["epoch"]
            self._skip = self.batches_yielded = state["batches_yielded"]
            # The next iteration draws the interrupted epoch's order again, from where it was drawn.
            self._replay = {k: rng.get(k) for k in _REPLAY_KEYS}
            self._set_generators(rng.get("generators"))  # as saved, until that iteration starts
        else:
            self._next_epoch = self.epoch = state["next_epoch"]
            self._skip = self.batches_yielded = 0
            self._replay = None
            self._set_generators(rng.get("generators"))

    def _load_global(self, state: dict[str, Any], rng: dict[str, Any]) -> None:
        """Resume from the global position of a checkpoint saved at another number of processes."""
        same_generators = len(rng.get("generators") or []) == len(self._generators())
        if same_generators:
            self._set_generators(rng.get("generators"))
        if not state["in_epoch"]:
            self._next_epoch = self.epoch = state["next_epoch"]
            self._skip = self.batches_yielded = 0
            self._replay = None
            return
        check_global_resume(self, state, "load_state_dict")
        done = global_position(self, state, "load_state_dict")
        self._next_epoch = self.epoch = state["epoch"]
        self._skip = 0
        self._offset, self._base = done, done // self._per_batch()
        self.batches_yielded = self._base
        self._replay = {k: rng.get(k) for k in _REPLAY_KEYS}
        if not same_generators:
            self._replay["generators_at_start"] = None
        self._replay["global_skip"] = done

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
        self._epoch_done = False
        replay, self._replay = self._replay, None
        if replay is None:
            self._offset = self._base = 0
            self._epoch_rng = torch.get_rng_state()
            self._epoch_generators = [g.get_state() for g in self._generators()]
            self._epoch_sampler_generator = self._sampler_generator_state()
        else:
            self._epoch_rng, self._epoch_generators = replay["iterator"], replay["generators_at_start"]
            self._epoch_sampler_generator = replay.get("sampler_generator_at_start")
            self._set_generators(self._epoch_generators)
            if self.shard_sampler is not None:
                self.shard_sampler.replay_rng = replay["batches"]
                if replay.get("global_skip"):  # saved at another number of processes
                    self.shard_sampler.global_skip = replay["global_skip"]
                    self.shard_sampler.replay_sampler = (replay.get("sampler_generator_at_start"),)
            self.batches_yielded = self._base + skip
        state = self.gradient_state
        # A loop inside another one's batch (evaluation during the last training batch) hands
        # the outer loop its end-of-data facts back when it finishes.
        outer = (state.end_of_dataloader, state.remainder)
        state.end_of_dataloader = False
        self.begin()
        self._iterating += 1
        move = self.device is not None and self.device.type != "cpu"
        non_blocking = bool(self.pin_memory)
        device = self.device
        try:
            base = self._start(skip, replay)
            # Look one batch ahead so the last batch is known before it is used.
            current = next(base, _END)
            while current is not _END:
                upcoming = next(base, _END)
                if upcoming is _END:
                    state.end_of_dataloader = self.end_of_dataloader = True
                    state.remainder = self.remainder = self._remainder()
                self.batches_yielded += 1
                yield send_to_device(current, device, non_blocking) if move else current
                current = upcoming
            self._epoch_done = True
        finally:  # also when the loop is left early (break), so later steps do not force a sync
            state.end_of_dataloader, state.remainder = outer
            self._iterating -= 1
            self.end()

    def _start(self, skip: int, replay: dict[str, Any] | None) -> Iterator[Any]:
        """This rank's batches of the epoch after its first ``skip`` (the DataLoader's own iterator)."""
        # Making the iterator draws the workers' base seed (from the global generator unless the
        # loader has its own); a resumed epoch draws it from the state its first run drew it from.
        with global_rng(replay["iterator"] if replay is not None else None):
            base = self._loader_iterator(skip if self.shard_sampler is not None else 0)
        if self.shard_sampler is None and skip:
            for _ in range(skip):
                next(base, None)
        return base

    def _loader_iterator(self, index_skip: int) -> Iterator[Any]:
        """The DataLoader's iterator; its batch sampler leaves out its first ``index_skip`` batches."""
        if not index_skip:
            return DataLoader.__iter__(self)
        # Index-level skip: the skipped batches are never loaded. The sampler's iterator is made
        # when the loader's is made or reset (persistent workers too): set it around that.
        self.shard_sampler.skip = index_skip
        try:
            return DataLoader.__iter__(self)
        finally:
            self.shard_sampler.skip = 0

    def _remainder(self) -> int:
        """The real samples of the last global batch when it is short, else 0 (Accelerate's remainder)."""
        if self.shard_sampler is not None:
            return self.shard_sampler.remainder
        if isinstance(self.dataset, IterableDatasetShard):
            # Items that are batches already (batch_size=None): their samples cannot be counted.
            return self.dataset.remainder if self.batch_size is not None else 0
        # One process over an iterable dataset: its length, if it has one, tells (as in Accelerate).
        if self.drop_last or not self.batch_size:
            return 0
        try:
            return len(self.dataset) % self.batch_size
        except TypeError:
            return 0


class DataLoaderShard(PreparedDataLoader):
    """A prepared dataloader whose every process loads its own share of each global batch: a
    ``ShardedBatchSampler`` over a map-style dataset, an ``IterableDatasetShard`` over an iterable one."""


_END = object()
_REPLAY_KEYS = ("iterator", "batches", "generators_at_start", "sampler_generator_at_start")


def _shared_order(state: Any) -> bool:
    """Whether several processes must draw the same order: several data ranks, or one data rank
    whose batch several processes share (pipeline, tensor, context parallelism)."""
    return state.num_processes > 1 or bool(getattr(state, "shares_batches", False))


def share_worker_seed(kwargs: dict[str, Any], batch_sampler: Any, state: Any) -> None:
    """Where several processes share each batch: the loader's base seed (what the workers' random
    transforms start from) the same on every one of them. The loader's own generator is put in rank
    0's state; without one, the sampler's shared generator draws it (one generator, as when a user
    gives both the same), or, with workers and no shuffling, a generator seeded by rank 0."""
    if not getattr(state, "shares_batches", False):
        return
    own = kwargs.get("generator")
    if own is not None:
        own.set_state(_from_main_process(state, own.get_state()))
        return
    shared = getattr(getattr(batch_sampler, "sampler", None), "generator", None)
    if isinstance(shared, torch.Generator):
        kwargs["generator"] = shared
    elif kwargs.get("num_workers", 0) > 0:
        kwargs["generator"] = torch.Generator().manual_seed(_from_main_process(state, _new_seed()))


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def _shuffling(
    batch_sampler: Any, state: ProcessState, seedable: bool, data_seed: int | None, share: bool = True
) -> Any:
    """``batch_sampler`` with its shuffling seeded as Accelerate seeds it (see the module's docstring).

    A plain ``BatchSampler`` gets a new sampler (the user's loader is left as it was); a custom
    batch sampler gets its ``sampler`` (or that sampler's ``generator``) set, as Accelerate does.
    ``share``: make every process's generator the same (not needed where one process draws).
    """
    sampler = getattr(batch_sampler, "sampler", None)
    plain = type(batch_sampler) is BatchSampler
    if seedable and isinstance(sampler, RandomSampler):
        seed = data_seed if data_seed is not None else _from_main_process(state, torch.initial_seed())
        # The user's generator, if any, is kept (reseeded each epoch), as in Accelerate.
        new: Sampler = SeedableRandomSampler(
            sampler.data_source, seed, sampler._num_samples, sampler.replacement, sampler.generator
        )
    elif share and _shared_order(state) and hasattr(sampler, "generator"):
        # Every process must draw the same order: one generator, in rank 0's state everywhere,
        # whose stream runs on from epoch to epoch (Accelerate's synchronized generator).
        if sampler.generator is not None:
            sampler.generator.set_state(_from_main_process(state, sampler.generator.get_state()))
            return batch_sampler
        generator = torch.Generator()
        generator.manual_seed(_from_main_process(state, _new_seed()))
        if not (plain and type(sampler) is RandomSampler):
            sampler.generator = generator
            return batch_sampler
        new = RandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples, generator=generator)
    else:
        return batch_sampler  # torch's own shuffling (one process), or nothing to shuffle
    if plain:
        return BatchSampler(new, batch_sampler.batch_size, batch_sampler.drop_last)
    batch_sampler.sampler = new
    return batch_sampler
