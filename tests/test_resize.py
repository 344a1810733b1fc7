"""Resuming at another number of processes: every sample of the epoch once, RNG states, the warning.

In-process: dataloaders of N "ranks" (ShardedBatchSampler with process_index r) save a global
position that M others continue. For real: 2 processes launched by ``hasten launch`` save
mid-epoch; 1 and 3 processes resume.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from hasten.data_loader.core import DataLoaderShard, ShardedBatchSampler
from hasten.data_loader.position import check_loader_state
from hasten.state import GradientState
from launch_utils import SCRIPTS, launch


def loaders(n, size, batch_size=3, shuffle=True, split=False, seed=7, drop_last=False):
    out = []
    for r in range(n):
        dataset = list(range(size))
        if shuffle:
            g = torch.Generator()
            g.manual_seed(seed)  # every rank agrees (prepare broadcasts rank 0's state)
            sampler = RandomSampler(dataset, generator=g)
        else:
            sampler = SequentialSampler(dataset)
        shard = ShardedBatchSampler(BatchSampler(sampler, batch_size, drop_last), n, r, split_batches=split)
        out.append(DataLoaderShard(dataset, None, GradientState(), batch_sampler=shard, collate_fn=list))
    return out


def run_and_save(n, size, k, **kw):
    """n ranks take k batches each; returns (samples seen, rank 0's state)."""
    seen = []
    ranks = loaders(n, size, **kw)
    states = []
    for dl in ranks:
        it = iter(dl)
        for _ in range(k):
            seen += next(it)
        states.append(dl.state_dict())
    return seen, states[0]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n,m", [(2, 1), (2, 3), (3, 2), (1, 4), (4, 3)])
def test_every_sample_once_at_another_number_of_processes(n, m, shuffle):
    size, k = 60, 2  # 20 batches of 3
    before, state = run_and_save(n, size, k, shuffle=shuffle)
    assert state["global_batches"] == k * n and state["in_epoch"] and state["num_processes"] == n
    after, dups = [], set()
    for dl in loaders(m, size, shuffle=shuffle, seed=99):  # another seed here: the saved states decide
        check_loader_state(dl, state, "test", resized=True)
        dl.load_state_dict(state)
        after += [i for b in dl for i in b]
        dups.add(dl.shard_sampler.duplicates)
    (padded,) = dups  # every rank knows the same number of padding samples
    assert padded == (-(20 - k * n) % m) * 3
    assert set(before + after) == set(range(size)) and len(before) + len(after) == size + padded
    if m == 1:  # the rest of the saving run's global order, in order
        g = torch.Generator()
        g.manual_seed(7)
        order = list(RandomSampler(range(size), generator=g)) if shuffle else list(range(size))
        assert after == order[k * n * 3 :]


def test_padding_at_the_end_is_counted_in_duplicates():
    size = 32  # 11 batches of 3 (the last of 2): 3 processes pad
    before, state = run_and_save(2, size, 2)
    after, dups = [], []
    for dl in loaders(3, size):
        dl.load_state_dict(state)
        after += [i for b in dl for i in b]
        dups.append(dl.shard_sampler.duplicates)
    assert set(before + after) == set(range(size))
    assert len(before) + len(after) == size + dups[0] and dups[0] > 0


def test_a_resized_run_saves_a_global_position_again_and_goes_on():
    size = 39
    before, state = run_and_save(2, size, 2)  # 4 of 13 batches
    middle, states = [], []
    three = loaders(3, size)
    for dl in three:
        dl.load_state_dict(state)
        it = iter(dl)
        middle += next(it)  # 3 more batches (one per rank)
        states.append(dl.state_dict())
    assert states[0]["global_batches"] == 7
    end = []
    for dl in loaders(2, size):  # back to 2 (7 is not a multiple of 2): the last 6
        dl.load_state_dict(states[0])
        end += [i for b in dl for i in b]
    assert sorted(before + middle + end) == list(range(size))
    # the same size again (3 -> 3) after an offset: also global
    again = []
    for dl in loaders(3, size):
        dl.load_state_dict(states[0])
        again += [i for b in dl for i in b]
    assert sorted(before + middle + again) == list(range(size))


def test_split_batches_and_epoch_boundary():
    size = 72  # 12 batches of 6 split in parts of 2 or 3
    before, state = run_and_save(2, size, 3, batch_size=6, split=True)
    assert state["global_batches"] == 3
    after = []
    for dl in loaders(3, size, batch_size=6, split=True):
        dl.load_state_dict(state)
        after += [i for b in dl for i in b]
    assert sorted(before + after) == list(range(size))
    # saved after a whole epoch: the next epoch starts from its beginning
    ranks = loaders(2, 30)
    for dl in ranks:
        list(dl)
    state = ranks[0].state_dict()
    assert not state["in_epoch"] and state["next_epoch"] == 1
    dl = loaders(3, 30)[0]
    dl.load_state_dict(state)
    assert dl.epoch == 1 and len(list(dl)) == 4  # ceil(10 / 3)


def test_what_cannot_be_carried_over_is_refused():
    _, state = run_and_save(2, 60, 2)
    dl = loaders(3, 60, batch_size=5)[0]  # 12 samples seen: inside a batch of 5 (issue 57: 4 or 6 resume)
    with pytest.raises(ValueError, match=r"batch_size was 3 when saved .* and is 5 now.*falls inside a batch of 5"):
        check_loader_state(dl, state, "load_state", resized=True)
    old = {k: state[k] for k in ("epoch", "batches_yielded", "next_epoch", "seed", "rng")}
    with pytest.raises(ValueError, match="without global positions"):
        check_loader_state(loaders(3, 60)[0], old, "load_state", resized=True)
    with pytest.raises(ValueError, match=r"'global_batches' must be in \[0, 20\]"):
        check_loader_state(loaders(3, 60)[0], {**state, "global_batches": 21}, "load_state", resized=True)


# ---------------------------------------------------------------------- real processes


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def runs(request, tmp_path_factory):
    """2 processes save mid-epoch; 1 and 3 resume. DDP: the "full" layout; FSDP2: "dcp", resharded."""
    out = tmp_path_factory.mktemp(f"resize_{request.param}")
    script = SCRIPTS / "resize_resume.py"
    extra = ["fsdp"] if request.param == "fsdp" else []
    prefix = "fsdp_" if extra else ""
    for n, phase in ((2, "save"), (1, "resume"), (3, "resume")):
        proc = launch("--num_processes", str(n), "--cpu", script, out, phase, *extra, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = {key: [json.loads((out / f"{prefix}{key[0]}_{key[1]}_rank{r}.json").read_text()) for r in range(key[1])]
            for key in (("save", 2), ("resume", 1), ("resume", 3))}  # fmt: skip
    assert all(r["layout"] == ("dcp" if extra else "full") for rs in runs.values() for r in rs)
    return runs


@pytest.mark.parametrize("m", [1, 3])
def test_launched_resume_at_another_number_of_processes(runs, m):
    saved, resumed = runs[("save", 2)], runs[("resume", m)]
    for name, size in (("even", 30), ("padded", 32)):
        before = [i for r in saved for b in r["before"][name] for i in b]
        after = [i for r in resumed for b in r["seen"][name] for i in b]
        assert set(before + after) == set(range(size)), name
        assert len(before) + len(after) == size + resumed[0]["duplicates"][name], name
        assert all(r["epoch"][name] == 0 for r in resumed)
    assert resumed[0]["duplicates"]["even"] == 0
    # the epoch after: whole, shared among the m processes (10 batches: 3 processes pad 2)
    nxt = [i for r in resumed for b in r["next_epoch"] for i in b]
    assert set(nxt) == set(range(30)) and len(nxt) == (30 if m == 1 else 36)
    # ranks the saving run had draw on from their saved states; a new rank from its own seed
    for r in range(min(m, 2)):
        assert resumed[r]["draw_after_load"] == saved[r]["draw_after_save"]
    if m == 3:
        assert resumed[2]["draw_after_load"] not in (saved[0]["draw_after_save"], saved[1]["draw_after_save"])
    # one warning, on the main process, with the old and new global batch sizes
    assert resumed[0]["warnings"] == [
        f"load_state: the checkpoint was saved by 2 process(es), this run has {m}: the global batch size "
        f"changes from 6 to {3 * m} (per-process batch x processes x gradient accumulation)"
    ]
    assert all(r["warnings"] == [] for r in resumed[1:])


class BucketBatches:
    """A custom batch sampler: batches of 2 or 4 (no batch_size), in an order from its sampler's generator."""

    def __init__(self, size, seed):
        g = torch.Generator()
        g.manual_seed(seed)
        self.sampler = RandomSampler(range(size), generator=g)

    def __iter__(self):
        order, i, k = list(self.sampler), 0, 0
        while i < len(order):
            width = 2 if k % 2 else 4
            yield order[i : i + width]
            i, k = i + width, k + 1

    def __len__(self):
        return -(-len(self.sampler) // 3)


def test_a_custom_batch_sampler_resumes_at_another_number_of_processes():
    size = 60  # batches 4, 2, 4, 2, ...: 20 of them

    def make(n):
        out = []
        for r in range(n):
            shard = ShardedBatchSampler(BucketBatches(size, 5), n, r)
            out.append(DataLoaderShard(list(range(size)), None, GradientState(), batch_sampler=shard, collate_fn=list))
        return out

    before, states = [], []
    for dl in make(2):
        it = iter(dl)
        before += next(it) + next(it)
        states.append(dl.state_dict())
    assert states[0]["batch_size"] is None and states[0]["global_batches"] == 4
    after = []
    for dl in make(4):  # 16 batches left: 4 each
        dl.load_state_dict(states[0])
        after += [i for b in dl for i in b]
    assert sorted(before + after) == list(range(size))


def test_an_iterable_dataset_mid_epoch_is_refused_at_another_size():
    from hasten.data_loader.core import IterableDatasetShard

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(40))

    def loader(n, r):
        return DataLoaderShard(IterableDatasetShard(Stream(), 4, n, r, False), None, GradientState(), batch_size=4)

    dl = loader(2, 0)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    assert state["in_epoch"] and state["global_batches"] == 2
    with pytest.raises(
        ValueError, match=r"iterable dataset, saved by 2 process\(es\) in the middle of epoch 0, cannot be carried to 3"
    ):
        check_loader_state(loader(3, 0), state, "load_state", resized=True)
    check_loader_state(loader(2, 0), state, "load_state")  # the same size: as before
    list(it)
    done = dl.state_dict()
    assert not done["in_epoch"]
    check_loader_state(loader(3, 0), done, "load_state", resized=True)  # at the epoch's end: fine
