"""``dispatch_batches=True``: the main process reads the loader, each process receives its part.

``DataLoaderDispatcher`` shares the position, epoch and resume logic of every prepared loader
(``core.PreparedDataLoader``); this module holds what is its own: reading on the main
process, cutting each step into the processes' parts, sending them (``broadcast_object_list``
for the structure, ``scatter`` for the tensors), and ``make_dispatcher``, which ``prepare``
calls for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from hasten.data_loader.core import (
    _END,
    PreparedDataLoader,
    ShardedBatchSampler,
    _loader_kwargs,
    _shuffling,
    global_rng,
)
from hasten.distributed.ops import broadcast_object_list
from hasten.distributed.state import LoopState, ProcessState


class DataLoaderDispatcher(PreparedDataLoader):
    """A prepared dataloader whose main process loads the batches and sends each process its part
    (``dispatch_batches=True``): for data only one process should read, such as a stream.

    Without ``split_batches`` the main process reads ``num_processes`` batches of the loader and
    process ``r`` gets the ``r``-th; with it, each batch is cut in ``num_processes`` parts along
    dim 0. Where the parts would not be alike (the last round has fewer batches, or batches of
    other sizes) the round's batches are joined and cut in equal parts; a number of samples
    that does not divide is completed with the first samples of the epoch (Accelerate's rule:
    every process gets as many batches, the last one maybe smaller; ``even_batches`` has no
    effect). ``drop_last`` drops an incomplete last round instead. The structure of each part
    (keys, shapes, dtypes) and its non-tensor values travel with ``broadcast_object_list``, the
    tensors with ``scatter`` (point-to-point sends where the processes' shapes differ), on the
    CPU with gloo and on the device with NCCL. Non-tensor values are not cut: a process given a
    whole batch gets that batch's, the parts of a cut batch each get its values, joined batches
    keep the first one's. The position is the number of the loader's batches consumed, as for a
    ``DataLoaderShard``: a checkpoint resumes it mid-epoch at the same or another number of
    processes (an iterable dataset's skipped batches are read again by the main process).
    """

    _main_process_reads = True

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None,
        gradient_state: LoopState,
        batch_sampler: ShardedBatchSampler | None = None,
        *,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        drop_incomplete: bool = False,
        comm_device: torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, device, gradient_state, batch_sampler=batch_sampler, **kwargs)
        self.num_processes = num_processes
        self.process_index = process_index
        self._split = split_batches
        self._drop_incomplete = drop_incomplete  # the loader's drop_last: an incomplete last round goes
        self._comm_device = comm_device if comm_device is not None else torch.device("cpu")
        self._step_remainder: int | list[Any] = 0
        self._seed_drawn = False
        if batch_sampler is not None:
            batch_sampler.head_size = num_processes  # the samples that complete the last batch

    @property
    def split_batches(self) -> bool:
        return self._split

    def _num_processes(self) -> int:
        return self.num_processes

    def _per_batch(self) -> int:
        return 1 if self._split else self.num_processes

    def _batch_size(self) -> int | None:
        return self.shard_sampler.batch_size if self.shard_sampler is not None else self.batch_size

    def __len__(self) -> int:
        whole = DataLoader.__len__(self)
        if self._split:
            return whole
        return whole // self.num_processes if self._drop_incomplete else math.ceil(whole / self.num_processes)

    def _remainder(self) -> int:
        if isinstance(self._step_remainder, list):  # one process: the last step's batch, counted now
            self._step_remainder = self._parts(self._step_remainder, None)[1]
        return self._step_remainder

    def _start(self, skip: int, replay: dict[str, Any] | None) -> Iterator[Any]:
        raw = skip * self._per_batch()  # this rank's batches -> the loader's batches
        map_style = self.shard_sampler is not None
        read_skip = 0 if map_style else raw + ((replay or {}).get("global_skip") or 0)
        # Every process draws what torch's DataLoader draws when its iterator is made (as in
        # Accelerate, where each process makes one), so the global random streams stay Accelerate's.
        with global_rng(replay["iterator"] if replay is not None else None):
            if self.process_index != 0:
                self._draw_base_seed()
            else:
                base = self._loader_iterator(raw if map_style else 0)
        if self.process_index != 0:
            return self._receive()
        # A map-style epoch that does not start at its first batch fetches its first samples by index.
        by_index = map_style and bool(raw or self.shard_sampler.global_skip)
        return self._send(base, read_skip, by_index)

    def _draw_base_seed(self) -> None:
        if self.num_workers > 0 and self.persistent_workers:
            if self._seed_drawn:  # the iterator, and its base seed, are made once
                return
            self._seed_drawn = True
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)

    # ---------------------------------------------------------------- the main process
    def _send(self, base: Iterator[Any], read_skip: int, head_by_index: bool) -> Iterator[Any]:
        n = self.num_processes
        head: Any = None  # the first samples of the epoch, to complete a last batch that does not divide
        while True:
            try:
                while read_skip > 0:  # an iterable dataset resumed mid-epoch: read the batches again
                    group = self._read(base, min(read_skip, self._per_batch()))
                    read_skip -= self._per_batch()
                    if head is None and group and n > 1:
                        head = _head_rows(group, n)
                group = self._read(base, self._per_batch())
                if not group or (len(group) < self._per_batch() and self._drop_incomplete):
                    break
                if n == 1:  # nothing to send or even out; the remainder is counted if the end asks for it
                    self._step_remainder = group
                    yield group[0]
                    continue
                if head is None and not head_by_index:
                    head = _head_rows(group, n)
                parts, remainder = self._parts(group, head)
            except Exception as e:
                if n > 1:  # the other processes wait for this step: tell them why it will not come
                    broadcast_object_list([("error", f"{type(e).__name__}: {e}")])
                raise
            self._step_remainder = remainder
            specs, leaves = [], []
            for part in parts:
                found: list[torch.Tensor] = []
                specs.append(_describe(part, found))
                leaves.append(found)
            broadcast_object_list([("step", specs, remainder)])
            self._exchange(specs, leaves)
            yield parts[0]
        if n > 1:
            broadcast_object_list([None])

    @staticmethod
    def _read(base: Iterator[Any], count: int) -> list[Any]:
        group = []
        for _ in range(count):
            batch = next(base, _END)
            if batch is _END:
                break
            group.append(batch)
        return group

    def _parts(self, group: list[Any], head: Any) -> tuple[list[Any], int]:
        """Each process's part of one step, and the real samples of the step when it is short."""
        n = self.num_processes
        sizes = [_rows(b) for b in group]
        real = sum(size or 0 for size in sizes)
        size = self._batch_size()
        full = None if size is None else size * self._per_batch()
        padded = 0
        if n == 1:
            parts = group
        elif not self._split and len(group) == n and len(set(sizes)) == 1:
            parts = group  # a whole batch each, as they came
        else:
            batch = _join(group)
            if not real:
                raise ValueError(
                    "dispatch_batches=True cuts a batch into one part per process along dim 0 of its tensors; "
                    f"this batch holds no tensor with a dim 0 ({type(batch).__name__})"
                )
            per = math.ceil(real / n)
            padded = per * n - real
            if padded:
                if head is None:
                    head = self._head_by_index()
                head_rows = _rows(head) or 0
                if not head_rows:
                    raise ValueError(
                        f"dispatch_batches=True: the last batch ({real} samples) does not divide into {n} parts "
                        "and the epoch's first samples cannot complete it (drop_last=True drops it instead)"
                    )
                batch = _join([batch, _take(head, torch.arange(padded) % head_rows, head_rows)])
            parts = [_take(batch, slice(r * per, (r + 1) * per), per * n) for r in range(n)]
        remainder = real if padded or (full is not None and real < full) else 0
        return parts, remainder

    def _head_by_index(self) -> Any:
        """The epoch's first samples, fetched again by index (an epoch resumed after its first batch)."""
        indices = self.shard_sampler.head if self.shard_sampler is not None else []
        if not indices:
            return None
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)

    # ---------------------------------------------------------------- the other processes
    def _receive(self) -> Iterator[Any]:
        while True:
            message = broadcast_object_list([None])[0]
            if message is None:
                return
            if message[0] == "error":
                raise RuntimeError(f"the main process could not make the next batch to dispatch: {message[1]}")
            _, specs, remainder = message
            self._step_remainder = remainder
            received = self._exchange(specs, None)
            yield _fill(specs[self.process_index], iter(received))

    def _exchange(self, specs: list[Any], leaves: list[list[torch.Tensor]] | None) -> list[torch.Tensor]:
        """Move each process's tensors to it (``leaves``: every process's, on the main process only)."""
        rank, device = self.process_index, self._comm_device
        shapes = [[(leaf.shape, leaf.dtype) for leaf in _leaves_of(spec)] for spec in specs]
        if all(s == shapes[0] for s in shapes):  # alike everywhere: one scatter per tensor
            received = []
            for i, (shape, dtype) in enumerate(shapes[rank]):
                out = torch.empty(shape, dtype=dtype, device=device)
                chunks = [leaves[r][i].to(device).contiguous() for r in range(len(specs))] if leaves else None
                dist.scatter(out, chunks, src=0)
                received.append(out)
            return received
        if leaves is not None:  # the main process sends each process its own
            requests = [dist.isend(t.to(device).contiguous(), dst=r) for r in range(1, len(specs)) for t in leaves[r]]
            for request in requests:
                request.wait()
            return leaves[0]
        received = []
        for shape, dtype in shapes[rank]:
            out = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(out, src=0)
            received.append(out)
        return received


class _Leaf:
    """A tensor of a dispatched batch as the receiving process learns of it: shape and dtype."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def _rebuild(data: Any, fn: Any, leaf: type) -> Any:
    """``data`` with ``fn`` applied to every ``leaf`` in its nested mappings, lists and tuples."""
    if isinstance(data, leaf):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: _rebuild(x, fn, leaf) for k, x in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_rebuild(x, fn, leaf) for x in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_rebuild(x, fn, leaf) for x in data)
    return data


def _describe(batch: Any, found: list[torch.Tensor]) -> Any:
    """``batch`` with each tensor replaced by its ``_Leaf`` (the tensors appended to ``found``, in order)."""

    def leaf(t: torch.Tensor) -> _Leaf:
        found.append(t)
        return _Leaf(tuple(t.shape), t.dtype)

    return _rebuild(batch, leaf, torch.Tensor)


def _leaves_of(spec: Any) -> list[_Leaf]:
    found: list[_Leaf] = []
    _rebuild(spec, found.append, _Leaf)
    return found


def _fill(spec: Any, tensors: Iterator[torch.Tensor]) -> Any:
    return _rebuild(spec, lambda _: next(tensors), _Leaf)


def _rows(batch: Any) -> int | None:
    """The number of samples of a batch: dim 0 of its first tensor that has one (None: no such tensor)."""
    found: list[int] = []
    _rebuild(batch, lambda t: found.append(t.shape[0]) if t.dim() and not found else None, torch.Tensor)
    return found[0] if found else None


def _take(batch: Any, index: slice | torch.Tensor, rows: int) -> Any:
    """The rows ``index`` of every tensor of ``batch`` that has ``rows`` rows (0-d tensors and
    other values are kept whole)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        if not t.dim():
            return t
        if t.shape[0] != rows:
            raise ValueError(
                f"dispatch_batches=True cuts every tensor of a batch along dim 0, which must be the batch's "
                f"{rows} samples; got a tensor of shape {tuple(t.shape)}"
            )
        return t[index.to(t.device) if isinstance(index, torch.Tensor) else index]

    return _rebuild(batch, cut, torch.Tensor)


def _join(batches: list[Any]) -> Any:
    """The batches as one, their tensors concatenated along dim 0 (other values: the first batch's)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if not first.dim():
            return first
        try:
            return torch.cat([b.to(first.device) for b in batches])
        except (RuntimeError, AttributeError) as e:
            shapes = [tuple(getattr(b, "shape", ())) for b in batches]
            raise ValueError(
                f"dispatch_batches=True joins batches of different sizes along dim 0 (here the last ones, to cut them "
                f"in equal parts), which needs tensors alike beyond dim 0; got shapes {shapes}. Pad the batches to one "
                "shape in the collate_fn, or use split_batches=True or dispatch_batches=False"
            ) from e
    if isinstance(first, Mapping):
        if any(not isinstance(b, Mapping) or list(b.keys()) != list(first.keys()) for b in batches):
            found = [list(b.keys()) if isinstance(b, Mapping) else type(b).__name__ for b in batches]
            raise ValueError(
                "dispatch_batches=True joins batches (here the last ones, to cut them in equal parts), which needs "
                f"batches with the same keys; got {found}"
            )
        return type(first)({k: _join([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)):
        if any(not isinstance(b, (list, tuple)) or len(b) != len(first) for b in batches):
            raise ValueError(
                "dispatch_batches=True joins batches (here the last ones, to cut them in equal parts), which needs "
                "batches of the same structure; got sequences of different lengths"
            )
        items = [_join([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return first


def _head_rows(group: list[Any], count: int) -> Any:
    """The first ``count`` samples of the batches of ``group`` as one batch (None where they cannot be taken)."""
    pieces = []
    taken = 0
    try:
        for batch in group:
            rows = _rows(batch)
            if not rows:
                continue
            k = min(rows, count - taken)
            pieces.append(_take(batch, slice(0, k), rows))
            taken += k
            if taken >= count:
                break
        return _join(pieces) if pieces else None
    except ValueError:
        return None


def make_dispatcher(
    loader: DataLoader,
    state: ProcessState,
    gradient_state: LoopState,
    device_placement: bool,
    split_batches: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> DataLoaderDispatcher:
    """``loader`` read by the main process, each process receiving its part of every step."""
    if not device_placement:
        raise ValueError(
            "dispatch_batches=True needs the batches placed on the device (device_placement=True, or "
            "put_on_device=True in prepare_data_loader): the parts arrive on each process's device"
        )
    n = state.num_processes
    if n > 1 and (not state.use_distributed or dist.get_world_size() != n or dist.get_rank() != state.process_index):
        raise ValueError(
            f"dispatch_batches=True sends each running process its part: num_processes={n} and "
            f"process_index={state.process_index} must be those of the process group"
        )
    kwargs = _loader_kwargs(loader)
    kwargs.pop("generator", None)  # as Accelerate: the loader's base seed is drawn from the global generator
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    if split_batches and (size is None or size % n):
        raise ValueError(
            f"split_batches=True needs a batch_size divisible by the number of processes, "
            f"got batch_size={size} and num_processes={n}"
        )
    backend = state.backend if n > 1 else None
    comm = state.device if backend is not None and "nccl" in str(backend) else torch.device("cpu")
    facts = {
        "num_processes": n,
        "process_index": state.process_index,
        "split_batches": split_batches,
        "drop_incomplete": loader.drop_last,
        "comm_device": comm,
    }
    if isinstance(loader.dataset, IterableDataset):
        return DataLoaderDispatcher(
            loader.dataset,
            state.device,
            gradient_state,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            **facts,
            **kwargs,
        )
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise ValueError("prepare() needs a DataLoader that batches (batch_size=None is not supported)")
    # Only the main process draws the order: no generator to share (as Accelerate), but the
    # seedable sampler where asked for.
    seedable = use_seedable_sampler or data_seed is not None
    batch_sampler = _shuffling(batch_sampler, state, seedable, data_seed, share=False)
    shard = ShardedBatchSampler(batch_sampler, 1, 0)  # the loader's own batches, on the main process
    return DataLoaderDispatcher(loader.dataset, state.device, gradient_state, batch_sampler=shard, **facts, **kwargs)
