"""Data loading as Accelerate's scripts expect it (measured by `make peer`): how the last batches
are evened out, ``dispatch_batches`` (``DataLoaderDispatcher``), ``set_epoch``/``iteration``,
``GradientState.active_dataloader``, iterable loaders with ``batch_size=None``, the seedable
sampler, and that an Accelerator and its loaders are freed without the garbage collector.

The 2-process dispatch checks share one launch of scripts/dispatch_checks.py; its mid-epoch
checkpoint is resumed here on one process.
"""

from __future__ import annotations

import gc
import json
import pickle
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from conftest import SCRIPTS, torchrun
from hasten import Accelerator, DataLoaderConfiguration, skip_first_batches
from hasten.data_loader.core import DataLoaderShard, ShardedBatchSampler
from hasten.data_loader.dispatch import DataLoaderDispatcher
from hasten.data_loader.prepare import prepare_loader as prepare_data_loader
from hasten.state import GradientState
from hasten.training.rng import set_seed


def shards(batch_sampler, n: int, cls=None, **kwargs) -> list[list[list[int]]]:
    from hasten.data_loader import BatchSamplerShard

    cls = cls or BatchSamplerShard
    return [list(cls(batch_sampler, n, r, **kwargs)) for r in range(n)]


def batches(n: int, size: int, drop_last: bool = False) -> BatchSampler:
    return BatchSampler(SequentialSampler(range(n)), size, drop_last)


def rank_state(rank: int, n: int = 2) -> SimpleNamespace:
    """The process facts prepare() reads, as rank ``rank`` of ``n`` (no process group needed)."""
    return SimpleNamespace(
        num_processes=n, process_index=rank, device=torch.device("cpu"), use_distributed=True, backend="gloo"
    )


class Stream(IterableDataset):
    def __init__(self, n: int, sized: bool = True):
        self.n, self.sized = n, sized

    def __iter__(self):
        return (torch.tensor(i) for i in range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("a stream")
        return self.n


# ---------------------------------------------------------------------- evening out the last batches


def test_padding_takes_the_epochs_first_samples_in_order():
    # 7 batches of 3 over 2 processes: the short last batch [18, 19] is completed first ([.., 0]),
    # then the missing batch of rank 1 continues where that stopped ([1, 2, 3]), not from 0 again.
    assert shards(batches(20, 3), 2) == [
        [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 0]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17], [1, 2, 3]],
    ]
    # Fewer samples than one round: they are cycled.
    assert shards(batches(2, 3), 2) == [[[0, 1, 0]], [[1, 0, 1]]]
    assert shards(batches(20, 3, drop_last=True), 2) == [
        [[0, 1, 2], [6, 7, 8], [12, 13, 14]],
        [[3, 4, 5], [9, 10, 11], [15, 16, 17]],
    ]


def test_batches_of_varying_size_are_completed_with_whole_first_batches():
    varying = [[0], [1, 2], [3, 4, 5], [6], [7, 8]]  # no batch_size: 5 batches, 3 processes
    got = shards(varying, 3)
    assert got == [[[0], [6]], [[1, 2], [7, 8]], [[3, 4, 5], [0]]]
    sampler = ShardedBatchSampler(varying, 3, 2)
    list(sampler)
    assert sampler.duplicates == 1 and sampler.remainder == 3  # [6], [7, 8] real, [0] repeated


def test_a_short_split_batch_is_cut_as_accelerate_cuts_it_in_batch_sampler_shard():
    # Parts of batch_size / num_processes: a short last batch gives parts to the first ranks only.
    assert shards(batches(21, 4), 2, split_batches=True, even_batches=False)[0][-1] == [20]
    assert shards(batches(21, 4), 2, split_batches=True, even_batches=False)[1][-1] == [18, 19]
    assert shards(batches(22, 4), 2, split_batches=True, even_batches=False) == [
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]],
    ]
    # With even_batches it is completed from the first batch, then cut.
    assert [s[-1] for s in shards(batches(21, 4), 2, split_batches=True)] == [[20, 0], [1, 2]]


def test_prepared_loaders_pad_alike_and_keep_every_rank_in_a_short_split_batch():
    loaders = [
        prepare_data_loader(DataLoader(list(range(20)), batch_size=3), rank_state(r), GradientState()) for r in range(2)
    ]
    assert [[b.tolist() for b in dl] for dl in loaders] == shards(batches(20, 3), 2)
    # split_batches without even_batches: the short batch [20, 21] gives each rank a part, so no
    # rank is left without a last batch (Accelerate's cut would leave rank 1 with none).
    split = [
        prepare_data_loader(
            DataLoader(list(range(22)), batch_size=4),
            rank_state(r),
            GradientState(),
            split_batches=True,
            even_batches=False,
        )
        for r in range(2)
    ]
    assert [[b.tolist() for b in dl][-1] for dl in split] == [[20], [21]]
    assert [len(dl) for dl in split] == [6, 6]


# ---------------------------------------------------------------------- set_epoch, iteration, active_dataloader


class EpochBatchSampler(BatchSampler):
    """A batch sampler with its own set_epoch, as Accelerate's test writes one."""

    def __init__(self, sampler, batch_size):
        super().__init__(sampler, batch_size, False)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch


def test_set_epoch_reaches_a_custom_batch_sampler_at_once():
    sampler = EpochBatchSampler(SequentialSampler(range(8)), 2)
    loader = Accelerator().prepare(DataLoader(list(range(8)), batch_sampler=sampler))
    loader.set_epoch(3)
    assert sampler.epoch == 3 and loader.iteration == 3
    seen = []
    for _ in loader:
        seen.append((loader.iteration, sampler.epoch))
    assert seen == [(3, 3)] * 4 and loader.iteration == 4 and loader.epoch == 3


def test_skip_first_batches_keeps_iteration_on_both_kinds():
    for config in (DataLoaderConfiguration(), DataLoaderConfiguration(dispatch_batches=True)):
        loader = Accelerator(dataloader_config=config).prepare(DataLoader(list(range(8)), batch_size=2))
        loader.set_epoch(2)
        skipped = skip_first_batches(loader, 3)
        assert skipped is loader and skipped.iteration == 2
        assert [b.tolist() for b in skipped] == [[6, 7]]


def test_active_dataloader_and_end_of_dataloader_in_nested_loops():
    acc = Accelerator()
    outer = acc.prepare(DataLoader(list(range(6)), batch_size=2))
    inner = acc.prepare(DataLoader(list(range(4)), batch_size=2))
    state = acc.gradient_state
    assert state.active_dataloader is None and not state.in_dataloader
    seen = []
    for i, _ in enumerate(outer):
        assert state.active_dataloader is outer
        if i == 1:
            for _ in inner:
                seen.append(
                    ("inner", state.active_dataloader is inner, state.end_of_dataloader, inner.end_of_dataloader)
                )
        seen.append(("outer", state.active_dataloader is outer, state.end_of_dataloader, outer.end_of_dataloader))
    assert seen == [
        ("outer", True, False, False),
        ("inner", True, False, False),
        ("inner", True, True, True),
        ("outer", True, False, False),  # the outer loop's own facts, back after the inner loop
        ("outer", True, True, True),
    ]
    assert state.active_dataloader is None and state.dataloader_references == [None]
    it = iter(outer)
    next(it)
    assert state.dataloader_references == [None, outer]
    del it  # a loop left early is no longer active
    assert state.active_dataloader is None


def test_an_accelerator_and_its_loaders_are_freed_without_the_garbage_collector():
    gc.disable()
    try:
        acc = Accelerator()
        loader = acc.prepare(DataLoader(list(range(8)), batch_size=2))
        it = iter(loader)
        next(it)
        refs = [weakref.ref(acc), weakref.ref(loader), weakref.ref(loader.gradient_state)]
        del acc, loader, it
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
    assert GradientState() is not None  # a fresh one once the Accelerator is gone


def test_gradient_state_pickles_as_its_own_object():
    acc = Accelerator(gradient_accumulation_steps=3)
    other = GradientState(5)
    copy = pickle.loads(pickle.dumps(other))
    assert copy is not acc.gradient_state and copy.num_steps == 5 and acc.gradient_state.num_steps == 3
    assert copy.active_dataloader is None


# ---------------------------------------------------------------------- iterable loaders with batch_size=None


def test_an_iterable_loader_of_whole_batches_is_prepared():
    batched = DataLoader(Stream(5), batch_size=None)  # each item is a batch already
    one = Accelerator().prepare_data_loader(batched)
    assert [b.tolist() for b in one] == [0, 1, 2, 3, 4]
    # On 2 processes each takes whole items in turn; the last round is completed from the start.
    ranks = [prepare_data_loader(batched, rank_state(r), GradientState(), device_placement=False) for r in range(2)]
    assert [[b.tolist() for b in dl] for dl in ranks] == [[0, 2, 4], [1, 3, 0]]
    with pytest.raises(ValueError, match="split_batches=True needs a batch_size divisible.*batch_size=None"):
        prepare_data_loader(batched, rank_state(0), GradientState(), device_placement=False, split_batches=True)


# ---------------------------------------------------------------------- the seedable sampler


def test_a_plain_loader_over_the_seedable_sampler_moves_to_the_next_epoch_by_itself():
    from hasten.data_loader import SeedableRandomSampler

    set_seed(42)
    generator = torch.Generator()
    generator.manual_seed(3)  # its initial seed is not the sampler's: torch's is, as in Accelerate
    sampler = SeedableRandomSampler(list(range(12)), generator=generator)
    assert sampler.initial_seed == 42
    plain = DataLoader(list(range(12)), batch_size=4, sampler=sampler)
    orders = [[int(i) for b in plain for i in b] for _ in range(3)]
    assert len({tuple(o) for o in orders}) == 3 and sampler.epoch == 3
    # The prepared loader sets the epoch itself and gives the same orders.
    sampler = SeedableRandomSampler(list(range(12)), generator=generator)
    prepared = Accelerator().prepare(DataLoader(list(range(12)), batch_size=4, sampler=sampler))
    assert [[int(i) for b in prepared for i in b] for _ in range(3)] == orders
    assert sampler.epoch == 2  # drawing the last epoch did not move it on


# ---------------------------------------------------------------------- dispatch_batches on one process


def test_dispatch_batches_none_resolves_as_in_accelerate():
    acc = Accelerator()
    assert isinstance(acc.prepare(DataLoader(Stream(4), batch_size=2)), DataLoaderDispatcher)
    assert isinstance(acc.prepare(DataLoader(list(range(4)), batch_size=2)), DataLoaderShard)
    placed_nowhere = Accelerator(device_placement=False).prepare(DataLoader(Stream(4), batch_size=2))
    assert type(placed_nowhere) is DataLoaderShard
    never = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    assert type(never.prepare(DataLoader(Stream(4), batch_size=2))) is DataLoaderShard


def test_a_dispatcher_knows_the_size_of_a_streams_last_batch():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(Stream(10, sized=False), batch_size=4))
    kept = [acc.gather_for_metrics(torch.zeros(4)).numel() for _ in loader]
    assert kept == [4, 4, 2] and loader.end_of_dataloader and loader.remainder == 2


def test_dispatcher_classes_as_accelerate_has_them():
    from hasten.data_loader import DataLoaderDispatcher as Dispatcher
    from hasten.data_loader import DataLoaderShard as Shard
    from hasten.data_loader import DataLoaderStateMixin, SkipDataLoader

    dl = Dispatcher(range(10), batch_size=4)
    assert isinstance(dl, DataLoader) and isinstance(dl, DataLoaderStateMixin) and not isinstance(dl, Shard)
    assert dl.base_dataloader is dl and isinstance(SkipDataLoader(range(4), skip_batches=1).base_dataloader, DataLoader)
    with pytest.raises(AttributeError, match="base_dataloader"):
        _ = Dispatcher.base_dataloader
    for _ in range(2):
        assert [(b.tolist(), dl.end_of_dataloader) for b in dl] == [
            ([0, 1, 2, 3], False),
            ([4, 5, 6, 7], False),
            ([8, 9], True),
        ]
    assert len(dl) == 3 and dl.iteration == 2
    made = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).prepare(
        DataLoader(list(range(4)), batch_size=2)
    )
    assert isinstance(made, Dispatcher) and not isinstance(made, Shard)
    with pytest.raises(ValueError, match="slice_fn=...\\) is not supported"):
        Dispatcher(range(4), batch_size=2, slice_fn=lambda *a, **k: a[0])


def test_an_accelerator_with_a_dispatcher_pickles():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare(DataLoader(list(range(7)), batch_size=3))
    loaded = pickle.loads(pickle.dumps(acc))._dataloaders[0]
    assert isinstance(loaded, DataLoaderDispatcher) and len(loaded) == len(loader) == 3
    assert [b.tolist() for b in loaded] == [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_dispatcher_resumes_mid_epoch_exactly(kind):
    def make(acc):
        if kind == "map":
            return acc.prepare(DataLoader(list(range(11)), batch_size=2, shuffle=True))
        return acc.prepare(DataLoader(Stream(11), batch_size=2))

    config = DataLoaderConfiguration(dispatch_batches=True)
    set_seed(3)
    straight = [b.tolist() for b in make(Accelerator(dataloader_config=config))]
    set_seed(3)
    first = make(Accelerator(dataloader_config=config))
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    position = first.state_dict()
    assert position["global_batches"] == 2 and position["in_epoch"]
    del it
    torch.manual_seed(1000)  # elsewhere in the global stream: the saved states decide
    second = make(Accelerator(dataloader_config=config))
    second.load_state_dict(position)
    assert head + [b.tolist() for b in second] == straight


# ---------------------------------------------------------------------- dispatch_batches on 2 processes


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    out = tmp_path_factory.mktemp("dispatch")
    proc = torchrun(SCRIPTS / "dispatch_checks.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_process_gets_its_batch_of_each_round(dispatched):
    _, ranks = dispatched
    assert [r["whole"]["batches"] for r in ranks] == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]]
    for r in ranks:
        assert r["whole"]["kind"] == "DataLoaderDispatcher" and r["whole"]["len"] == 3
        assert r["whole"]["ends"] == [False, False, True] and r["whole"]["active_after"]
        # gather_for_metrics: every sample once; the last step's real samples are all there.
        assert r["whole"]["kept"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and r["whole"]["remainders"][-1] == 2


def test_a_last_batch_that_does_not_divide_is_completed_and_trimmed_again(dispatched):
    _, ranks = dispatched
    for case in ("padded", "stream"):  # 11 samples in batches of 2: [8, 9] and [10] joined, then cut
        assert [r[case]["batches"][-1] for r in ranks] == [[8, 9], [10, 0]]
        for r in ranks:
            assert r[case]["kept"][-1] == [8, 9, 10] and r[case]["remainders"][-1] == 3
    assert ranks[0]["stream"]["len"] is None


def test_split_batches_and_drop_last_when_dispatching(dispatched):
    _, ranks = dispatched
    assert [r["split"]["batches"] for r in ranks] == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]]
    assert [r["drop_last"]["batches"] for r in ranks] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert ranks[0]["drop_last"]["len"] == 2 and ranks[0]["split"]["len"] == 3


def test_the_main_process_draws_the_order_as_a_plain_loader(dispatched):
    _, ranks = dispatched
    for r in ranks:
        assert [i for b in r["shuffled"]["gathered"] for i in b] == r["shuffled"]["reference"]


def test_structures_strings_and_shapes_that_differ_between_processes(dispatched):
    _, ranks = dispatched
    r0, r1 = (r["structured"] for r in ranks)
    # Round 1: rank 0 gets batch [0, 1] (width 1), rank 1 batch [2, 3] (width 3), each with its tag.
    assert r0[0] == {"x": [[0.0], [1.0]], "tag": "from 0"} and r1[0] == {"x": [[2.0] * 3, [3.0] * 3], "tag": "from 2"}
    # The last batch alone is cut in two; both parts keep its tag.
    assert r0[-1] == {"x": [[8.0] * 3], "tag": "from 8"} and r1[-1] == {"x": [[9.0] * 3], "tag": "from 8"}


def test_a_failure_on_the_main_process_reaches_every_process(dispatched):
    _, ranks = dispatched
    assert ranks[0]["failure"] == "KeyError: 'sample 5 is missing'"
    assert ranks[1]["failure"] == (
        "RuntimeError: the main process could not make the next batch to dispatch: KeyError: 'sample 5 is missing'"
    )


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_two_processes_resume_mid_epoch_exactly(dispatched, kind):
    _, ranks = dispatched
    for r in ranks:
        assert r[f"resume_{kind}"]["resumed"] == r[f"resume_{kind}"]["straight"]


def test_a_checkpoint_of_two_processes_resumes_on_one(dispatched):
    out, ranks = dispatched
    assert ranks[0]["saved_kinds"] == [True, True]
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    acc.prepare(torch.nn.Linear(1, 1))
    loaders = acc.prepare(DataLoader(list(range(13)), batch_size=2, shuffle=True), DataLoader(Stream(13), batch_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the global batch size changes: said in a warning
        acc.load_state(out / "ckpt")
    for before, loader in zip(ranks[0]["before_save"], loaders):
        seen = [i for step in before for i in step]
        rest = [i for b in loader for i in b.tolist()]
        assert len(seen) == 8 and sorted(seen + rest) == list(range(13))  # every sample of the epoch once
