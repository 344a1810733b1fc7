"""Issue 57, sixth reliability round: resume, and the Hugging Face Trainer's order of calls.

- FSDP2: an evaluation forward (no backward) between ``prepare(model)`` and preparing the optimizer
  (the Trainer's ``evaluate()`` before ``train()``) trains exactly as without it (2 processes).
- A mid-epoch position carries over to another number of processes keeping the global batch
  (2 x 2 saved, 1 x 4 loaded): the rest of the epoch is an uninterrupted run's at the new shape;
  only a position that cannot be counted in the new batches is refused, saying why.
- Pipeline parallelism over many sequence lengths: the memory each process keeps stays bounded.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler

from hasten.data_loader.core import DataLoaderShard, SeedableRandomSampler, ShardedBatchSampler
from hasten.data_loader.position import check_loader_state
from hasten.state import GradientState
from launch_utils import SCRIPTS, launch, read_ranks

# --------------------------------------------------------------------------- FSDP2, evaluation first


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_fsdp2_evaluation_before_training_trains_as_without_it(tmp_path):
    proc = launch("--num_processes", "2", "--cpu", SCRIPTS / "round6_resume_eval_first.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in read_ranks(tmp_path, 2):
        plain = rank["plain"]
        assert "error" not in plain, plain
        for how in ("model_and_optimizer", "optimizer_alone", "eval_with_grad"):
            got = rank[how]
            assert "error" not in got, f"{how}: {got['error']}\n{got['trace']}"
            assert got["sharded"], how  # the optimizer holds the shards, not the unsharded parameters
            assert got["losses"] == plain["losses"], how  # exactly, every step
            assert got["weights"] == plain["weights"], how


# --------------------------------------------------------------------------- the global batch kept


def loaders(n, size, batch_size, seed=3, split=False, batch_sampler=BatchSampler):
    """n ranks of a seedable shuffled loader (the same order at any number of processes)."""
    out = []
    for r in range(n):
        dataset = list(range(size))
        sampler = SeedableRandomSampler(dataset, seed)
        shard = ShardedBatchSampler(batch_sampler(sampler, batch_size, False), n, r, split_batches=split)
        out.append(DataLoaderShard(dataset, None, GradientState(), batch_sampler=shard, collate_fn=list))
    return out


def save_after(ranks, k):
    seen, states = [], []
    for dl in ranks:
        it = iter(dl)
        seen.append([next(it) for _ in range(k)])
        states.append(dl.state_dict())
    return seen, states[0]


def steps(ranks):
    """The global batches (each rank's part, in rank order) of the rest of the epoch."""
    parts = [list(dl) for dl in ranks]
    return [sum((p[i] for p in parts if i < len(p)), []) for i in range(max(map(len, parts)))]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((2, 2, False), (1, 4, False)),  # the case
        ((1, 4, False), (2, 2, False)),
        ((4, 1, False), (2, 2, False)),
        ((2, 4, True), (1, 4, False)),  # split_batches on one side: the same samples per step
        ((1, 4, False), (2, 4, True)),
        ((2, 2, False), (2, 4, True)),  # the same number of processes, another batch kind
    ],
)
def test_mid_epoch_position_kept_in_samples_keeping_the_global_batch(saved, loaded):
    size, k = 48, 3  # 12 global batches of 4; save after 3 steps
    n, b, split = saved
    _, state = save_after(loaders(n, size, b, split=split), k)
    m, c, split2 = loaded
    after_loaders = loaders(m, size, c, seed=99, split=split2)  # another seed here: the saved state decides
    for dl in after_loaders:
        check_loader_state(dl, state, "load_state", resized=n != m)
        dl.load_state_dict(state)
    got = steps(after_loaders)
    whole = steps(loaders(m, size, c, split=split2))  # an uninterrupted run at the new shape
    assert got == whole[k:]
    # and a save right after the resume counts in the new batches
    dl = loaders(m, size, c, split=split2)[0]
    dl.load_state_dict(state)
    again = dl.state_dict()
    resumed = loaders(m, size, c, split=split2)
    for d in resumed:
        d.load_state_dict(again)
    assert steps(resumed) == whole[k:]


def test_a_position_inside_a_batch_or_not_in_samples_is_refused():
    _, state = save_after(loaders(2, 60, 3), 2)  # 4 batches of 3: 12 samples
    before = loaders(1, 60, 5)[0]
    with pytest.raises(ValueError, match=r"after 12 samples, falls inside a batch of 5: resume with a batch_size"):
        check_loader_state(before, state, "load_state", resized=True)
    with pytest.raises(ValueError, match=r"batch_size was 3 when saved .* and is 5 now"):
        before.load_state_dict(state)
    assert before.epoch == 0 and before.batches_yielded == 0  # a refused load changes nothing

    class Buckets(BatchSampler):  # a subclass: its grouping at another batch size is not known
        pass

    odd = loaders(1, 60, 6, batch_sampler=Buckets)[0]
    with pytest.raises(ValueError, match=r"cannot be counted in samples: the batch sampler Buckets"):
        check_loader_state(odd, state, "load_state", resized=True)
    fine = loaders(1, 60, 6)[0]  # 12 samples = 2 batches of 6
    check_loader_state(fine, state, "load_state", resized=True)


def test_same_processes_another_batch_size_is_counted_in_samples_not_in_batches():
    """2 x 2 saved, 2 x 4 loaded (a global batch of 8): before, the saved 2 batches per rank were
    skipped as 2 of the new ones (16 samples instead of 8)."""
    size = 48
    _, state = save_after(loaders(2, size, 2), 2)  # 8 samples
    after = loaders(2, size, 4)
    for dl in after:
        check_loader_state(dl, state, "load_state")
        dl.load_state_dict(state)
    assert steps(after) == steps(loaders(2, size, 4))[1:]


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_launched_global_batch_resume_matches_an_uninterrupted_run(tmp_path):
    script = SCRIPTS / "round6_resume_global_batch.py"
    for n, phase in ((2, "save"), (1, "resume"), (1, "whole")):
        proc = launch("--num_processes", str(n), "--cpu", script, tmp_path, phase, timeout=240)
        assert proc.returncode == 0, f"{phase}: " + proc.stdout + proc.stderr
    saved = json.loads((tmp_path / "save_rank0.json").read_text())
    resumed = json.loads((tmp_path / "resume_rank0.json").read_text())
    whole = json.loads((tmp_path / "whole_rank0.json").read_text())
    k = len(saved["samples"])
    assert saved["samples"] == whole["samples"][:k]  # the same order at both shapes
    assert resumed["samples"] == whole["samples"][k:]  # the rest of the epoch, exactly
    assert torch.allclose(torch.tensor(saved["losses"]), torch.tensor(whole["losses"][:k]), atol=1e-6)
    assert torch.allclose(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][k:]), atol=1e-6)
    assert torch.allclose(torch.tensor(resumed["weight"]), torch.tensor(whole["weight"]), atol=1e-6)


# --------------------------------------------------------------------------- pipeline memory


@pytest.mark.slow
def test_pipeline_memory_over_many_sequence_lengths_stays_bounded(tmp_path):
    """30 lengths through a 2-stage pipeline: each process's RSS after the last step is within
    150 MB of the first step's (before issue 57: 138-282 MB; now ~22 MB, the kept schedules' buffers)."""
    script = SCRIPTS / "round6_resume_pp_memory.py"
    proc = launch("--num_processes", "2", "--cpu", script, tmp_path, "30", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in read_ranks(tmp_path, 2):
        assert rank["kept"] == 8 and rank["stages_alive"] == 8  # evicted schedules' stages are freed
        assert rank["growth"] < 150 * 2**20, [p["rss"] >> 20 for p in rank["points"]]
