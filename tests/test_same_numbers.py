"""Same script, same numbers: where hasten must give Accelerate's numbers for the same seed.

1. A prepared LR scheduler steps ``num_processes`` times per optimizer step (once with
   ``split_batches``; every call with ``step_scheduler_with_optimizer=False``), never on
   accumulation micro-steps or fp16-skipped steps, never past a OneCycleLR's ``total_steps``.
2. ``gather_for_metrics`` keeps only the real samples of the last batch, on one process too.
3. Shuffling draws what Accelerate draws: same order, same global random stream after it.

The 2-process checks share one launch of scripts/same_numbers_checks.py. At the end, one training
script (scripts/same_numbers_train.py) runs under hasten and, where it is installed, Accelerate,
on 1 and 2 processes, and under hasten again stopped at a mid-epoch checkpoint and resumed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration, GradScalerKwargs
from hasten.training.rng import capture_rng_state, restore_rng_state, set_seed
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks

TIMEOUT = 240


def _draw(generator: torch.Generator | None = None) -> int:
    """One int64 draw: how torch's DataLoader draws its base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


# ---------------------------------------------------------------------- 1. the LR scheduler, 1 process


def _train(accelerator: Accelerator, scheduler_factory, batches: int = 8, loss_scale: float = 1.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = scheduler_factory(optimizer)
    loader = DataLoader(TensorDataset(torch.randn(batches, 2)), batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    seen = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum() * loss_scale)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen.append((scheduler.scheduler.last_epoch, optimizer.real_steps))
    return seen, scheduler


def _lambda(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 / (1 + e))


@pytest.mark.parametrize("split", [False, True])
def test_one_process_steps_once_per_real_step_whatever_split_batches(split):
    config = DataLoaderConfiguration(split_batches=split)
    accelerator = Accelerator(gradient_accumulation_steps=2, dataloader_config=config)
    seen, _ = _train(accelerator, _lambda)
    assert seen == [(0, 0), (1, 1), (1, 1), (2, 2), (2, 2), (3, 3), (3, 3), (4, 4)]  # never on micro-steps


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_step_scheduler_with_optimizer_false_steps_on_every_call():
    accelerator = Accelerator(gradient_accumulation_steps=2, step_scheduler_with_optimizer=False)
    seen, _ = _train(accelerator, _lambda)
    assert [epoch for epoch, _ in seen] == list(range(1, 9))
    assert seen[-1][1] == 4


def test_fp16_skipped_steps_do_not_step_the_scheduler():
    # A loss of ~1e3 scaled by 2**8 overflows fp16 gradients: the first steps are skipped until the scale is small.
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**8)])
    seen, _ = _train(accelerator, _lambda, loss_scale=1e3)
    epochs, real = zip(*seen)
    assert real[0] == 0 and real[-1] > 0  # skipped, then real steps
    assert list(epochs) == list(real)


def test_one_cycle_is_never_stepped_past_total_steps():
    # 8 optimizer steps for a OneCycleLR of 5: torch raises on the 6th step; Accelerate stops at 5.
    seen, scheduler = _train(Accelerator(), lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=5))
    assert [epoch for epoch, _ in seen] == [1, 2, 3, 4, 5, 5, 5, 5]
    plain_optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.OneCycleLR(plain_optimizer, max_lr=1.0, total_steps=5)
    for _ in range(5):
        plain_optimizer.step()
        plain.step()
    assert scheduler.get_last_lr() == plain.get_last_lr()


def test_scheduler_state_round_trip_and_accelerates_stepping_rule():
    accelerator = Accelerator()
    seen, scheduler = _train(accelerator, _lambda, batches=3)
    state = scheduler.state_dict()
    scheduler.scheduler.last_epoch = 0
    scheduler.load_state_dict(state)
    assert scheduler.scheduler.last_epoch == 3
    # As Accelerate's: a step() with synchronised gradients steps unless an optimizer's step was skipped.
    optimizer = accelerator._optimizers[0]
    optimizer._is_overflow = True
    scheduler.step()
    assert scheduler.scheduler.last_epoch == 3 and optimizer.step_was_skipped
    optimizer._is_overflow = False
    scheduler.step()
    assert scheduler.scheduler.last_epoch == 4
    accelerator.gradient_state.sync_gradients = False  # an accumulation micro-step
    scheduler.step()
    assert scheduler.scheduler.last_epoch == 4


# ---------------------------------------------------------------------- 2. gather_for_metrics, 1 process


class _Numbers(IterableDataset):
    def __init__(self, n: int, sized: bool = True):
        self.n, self.sized = n, sized

    def __iter__(self):
        yield from (torch.tensor(i) for i in range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return self.n


def _gathered(loader_kwargs: dict, data=None, **accelerator_kwargs) -> tuple[list[int], list[int]]:
    accelerator = Accelerator(**accelerator_kwargs)
    loader = accelerator.prepare(DataLoader(torch.arange(10.0) if data is None else data, **loader_kwargs))
    size = loader_kwargs["batch_size"]
    per_batch = [accelerator.gather_for_metrics(torch.zeros(size)).numel() for _ in loader]
    objects = [len(accelerator.gather_for_metrics(list(range(size)), use_gather_object=True)) for _ in loader]
    return per_batch, objects


def test_gather_for_metrics_drops_the_padding_of_the_last_batch_on_one_process():
    # The repro: a per-sample metric of a full-size batch (loss.repeat(batch_size)).
    assert _gathered({"batch_size": 4}) == ([4, 4, 2], [4, 4, 2])
    assert _gathered({"batch_size": 5}) == ([5, 5], [5, 5])  # nothing short, nothing dropped
    assert _gathered({"batch_size": 4, "drop_last": True}) == ([4, 4], [4, 4])
    assert _gathered({"batch_size": 4}, split_batches=True) == ([4, 4, 2], [4, 4, 2])
    assert _gathered({"batch_size": 4}, data=_Numbers(10)) == ([4, 4, 2], [4, 4, 2])  # a sized iterable
    # A stream without a length: dispatched by default (as in Accelerate), the last batch's size is seen.
    assert _gathered({"batch_size": 4}, data=_Numbers(10, sized=False)) == ([4, 4, 2], [4, 4, 2])
    no_dispatch = DataLoaderConfiguration(dispatch_batches=False)
    assert _gathered({"batch_size": 4}, data=_Numbers(10, sized=False), dataloader_config=no_dispatch) == (
        [4, 4, 4],
        [4, 4, 4],
    )  # read by each process itself: unknowable


def test_gather_for_metrics_outside_the_last_batch_keeps_everything():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(10.0), batch_size=4))
    for _ in loader:
        pass
    assert accelerator.gather_for_metrics(torch.zeros(4)).numel() == 4  # the loop is over


# ---------------------------------------------------------------------- 3. shuffling, 1 process


def _orders_and_stream(loader, epochs: int = 3) -> tuple[list, list[float]]:
    orders, after = [], []
    for _ in range(epochs):
        orders.append([b.tolist() for (b,) in loader])
        after.append(torch.rand(1).item())
    return orders, after


def _plain_and_prepared(config: DataLoaderConfiguration | None = None, **loader_kwargs):
    """The same loop on a plain torch DataLoader and on a prepared one, from the same seed."""
    runs = []
    for prepare in (False, True):
        set_seed(3)
        generator = torch.Generator().manual_seed(9) if loader_kwargs.get("generator") else None
        loader = DataLoader(
            TensorDataset(torch.arange(13)), batch_size=4, shuffle=True, **{**loader_kwargs, "generator": generator}
        )
        if prepare:
            loader = Accelerator(dataloader_config=config).prepare(loader)
        runs.append(_orders_and_stream(loader))
    return runs


@pytest.mark.parametrize(
    "loader_kwargs", [{}, {"generator": True}, {"num_workers": 1}], ids=["global", "generator", "worker"]
)
def test_one_process_shuffles_as_plain_torch(loader_kwargs):
    """Accelerate leaves a one-process loader to torch: same order, same global stream after."""
    plain, prepared = _plain_and_prepared(**loader_kwargs)
    assert prepared == plain
    assert prepared[0][0] != prepared[0][1]  # a new order each epoch


def test_seedable_sampler_seeds_each_epoch_from_the_initial_seed():
    set_seed(3)
    loader = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)).prepare(
        DataLoader(TensorDataset(torch.arange(13)), batch_size=4, shuffle=True)
    )
    orders, after = _orders_and_stream(loader)
    set_seed(3)
    expected, stream = [], []
    for epoch in range(3):
        _draw()  # the loader's base seed: the only draw from the global stream
        order = list(RandomSampler(range(13), generator=torch.Generator().manual_seed(3 + epoch)))
        expected.append([order[i : i + 4] for i in range(0, 13, 4)])
        stream.append(torch.rand(1).item())
    assert orders == expected and after == stream
    # data_seed replaces the initial seed (and needs no use_seedable_sampler in hasten).
    set_seed(3)
    seeded = Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=4)).prepare(
        DataLoader(TensorDataset(torch.arange(13)), batch_size=4, shuffle=True)
    )
    assert _orders_and_stream(seeded)[0][:2] == expected[1:]


@pytest.mark.parametrize(
    "config, loader_kwargs",
    [(None, {}), (None, {"generator": True}), (DataLoaderConfiguration(use_seedable_sampler=True), {})],
    ids=["global", "generator", "seedable"],
)
def test_mid_epoch_resume_gives_the_uninterrupted_order_and_stream(config, loader_kwargs):
    def make():
        set_seed(3)
        generator = torch.Generator().manual_seed(9) if loader_kwargs else None
        return Accelerator(dataloader_config=config).prepare(
            DataLoader(TensorDataset(torch.arange(13)), batch_size=4, shuffle=True, generator=generator)
        )

    reference = _orders_and_stream(make())
    first = make()
    _orders_and_stream(first, epochs=1)
    it = iter(first)
    head = [next(it)[0].tolist(), next(it)[0].tolist()]
    saved, rng = first.state_dict(), capture_rng_state()  # what save_state keeps
    del it
    torch.manual_seed(99)  # whatever a fresh process drew before loading
    second = make()
    second.load_state_dict(saved)
    restore_rng_state(rng)  # load_state restores the loaders, then the generators
    rest = [b.tolist() for (b,) in second]
    after = torch.rand(1).item()
    more = _orders_and_stream(second, epochs=1)
    assert head + rest == reference[0][1] and after == reference[1][1]
    assert more == ([reference[0][2]], [reference[1][2]])


def test_a_state_with_other_generators_is_refused():
    loader = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4, shuffle=True))
    state = loader.state_dict()
    state["rng"]["generators"] = [torch.Generator().get_state()]
    with pytest.raises(ValueError, match="holds 1 generator state.*has 0 generator"):
        loader.load_state_dict(state)


# ---------------------------------------------------------------------- 2 processes, one launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("same_numbers_checks")
    proc = launch("--num_processes", "2", SCRIPTS / "same_numbers_checks.py", out, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_ranks(out, 2)


@pytest.mark.parametrize(
    "split, with_optimizer, steps_per_step",
    [(False, True, 2), (True, True, 1), (False, False, None), (True, False, None)],
)
def test_two_processes_scheduler_steps(ranks, split, with_optimizer, steps_per_step):
    for res in ranks:
        seen = res["scheduler"][f"split={split},with_optimizer={with_optimizer}"]["micro_steps"]
        assert len(seen) == (8 if split else 4) and seen[-1]["real_steps"] == len(seen) // 2
        for i, m in enumerate(seen):
            if steps_per_step is None:  # not tied to the optimizer: every call steps it once
                assert m["last_epoch"] == i + 1
            else:  # num_processes (or, with split batches, 1) steps per real optimizer step
                assert m["last_epoch"] == steps_per_step * m["real_steps"]
            assert m["lr"] == pytest.approx(1.0 / (1 + m["last_epoch"]))


def test_two_processes_one_cycle_stops_at_total_steps(ranks):
    for res in ranks:
        c = res["one_cycle"]
        assert c["error"] is None and c["last_epoch"] == 6
        assert c["lrs"] == c["reference"] and len(c["lrs"]) == 4


@pytest.mark.parametrize(
    "case, per_batch",
    [
        ("10/4", [8, 2]),
        ("10/4 split", [4, 4, 2]),
        ("10/4 split uneven", [4, 4, 2]),
        ("5/4", [5]),
        ("13/3", [6, 6, 1]),
        ("12/4 drop_last", [8]),
        ("10/4 iterable", [8, 2]),
    ],
)
def test_two_processes_gather_for_metrics_keeps_the_real_samples(ranks, case, per_batch):
    for res in ranks:
        g = res["gather"][case]
        assert g["per_batch"] == per_batch
        assert sorted(g["values"]) == list(range(sum(per_batch)))  # each real sample once, no padding
        assert g["padded_total"] == sum(per_batch)  # full-size per-sample metrics: the padding dropped


@pytest.mark.parametrize("mode", ["default", "seedable", "data_seed", "generator"])
def test_two_processes_shuffle_order_and_global_stream(ranks, mode):
    reference = ranks[0][f"{mode}_reference"]
    r0, r1 = (res[mode] for res in ranks)
    for epoch in range(2):
        # Global batch i is rank 0's batch i, then rank 1's: together, the reference permutation.
        both = [i for b0, b1 in zip(r0["orders"][epoch], r1["orders"][epoch]) for i in b0 + b1]
        assert both[:13] == reference["permutations"][epoch]
    assert r0["after"] == reference["after"] and r1["after"] == reference["after"]


def test_two_processes_with_different_seeds_still_share_one_order(ranks):
    r0, r1 = (res["device_specific"] for res in ranks)
    for epoch in range(2):
        assert sorted({i for b in r0["orders"][epoch] + r1["orders"][epoch] for i in b}) == list(range(13))
        assert not {i for b in r0["orders"][epoch][:-1] for i in b} & {i for b in r1["orders"][epoch][:-1] for i in b}


# ---------------------------------------------------------------------- one training script, both libraries


def _script(tmp_path, library: str):
    text = (SCRIPTS / "same_numbers_train.py").read_text()
    if library == "hasten":
        text = text.replace("from accelerate", "from hasten")
    path = tmp_path / f"train_{library}.py"
    path.write_text(text)
    return path


def _run(library: str, nproc: int, tmp_path, out, *args) -> None:
    script = _script(tmp_path, library)
    if nproc == 1:
        cmd = [sys.executable, str(script), str(out), *args]
        proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    elif library == "hasten":
        proc = launch("--num_processes", str(nproc), script, out, *args, timeout=TIMEOUT)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            # the real Accelerate in hasten's worker wrapper, which only ends the process in order: the
            # interpreter's own teardown races gloo's threads (SIGABRT at exit, tests/test_exit.py)
            "-m",
            "hasten.cli._child",
            str(script),
            str(out),
            *args,
        ]
        proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


STOP_AT = ("1", "2")  # after batch 2 of epoch 1: the end of an accumulation cycle, mid-epoch


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def runs(request, tmp_path_factory):
    nproc = request.param
    tmp = tmp_path_factory.mktemp(f"same_numbers_{nproc}")
    hasten_out = tmp / "hasten"
    hasten_out.mkdir()
    _run("hasten", nproc, tmp, hasten_out, "straight,stop", *STOP_AT)
    _run("hasten", nproc, tmp, hasten_out, "resume")  # a fresh process
    result = {"nproc": nproc, "tmp": tmp}
    for mode in ("straight", "stop", "resume"):
        result[mode] = [json.loads((hasten_out / f"{mode}_rank{r}.json").read_text()) for r in range(nproc)]
    return result


def test_hasten_run_is_what_the_script_asks_for(runs):
    for res in runs["straight"]:
        assert res["num_processes"] == runs["nproc"]
        records = res["records"]
        # 30 samples in batches of 4: 8 batches, 8 or 4 per process, for 3 epochs.
        assert len(records) == 3 * 8 // runs["nproc"]
        assert records[0]["lr"] == 0.0 and max(r["lr"] for r in records) == pytest.approx(0.05)  # warm-up, then decay
        assert [e["count"] for e in res["evals"]] == [9, 9, 9]  # exactly the 9 evaluation samples


def test_hasten_resumed_from_mid_epoch_equals_the_uninterrupted_run(runs):
    for straight, stopped, resumed in zip(runs["straight"], runs["stop"], runs["resume"]):
        assert (stopped["records"][-1]["epoch"], stopped["records"][-1]["batch"]) == tuple(map(int, STOP_AT))
        assert resumed["records"][0]["batch"] == int(STOP_AT[1]) + 1
        assert stopped["records"] + resumed["records"] == straight["records"]  # every loss and lr, exactly
        assert stopped["evals"] + resumed["evals"] == straight["evals"]
        assert resumed["after"] == straight["after"]  # and the global random stream after it


def test_hasten_gives_accelerates_numbers(runs):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("Accelerate is not installed (pip install 'hasten[parity]'): nothing to compare with")
    out = runs["tmp"] / "accelerate"
    out.mkdir(exist_ok=True)
    _run("accelerate", runs["nproc"], runs["tmp"], out, "straight")
    for r, ours in enumerate(runs["straight"]):
        theirs = json.loads((out / f"straight_rank{r}.json").read_text())
        assert theirs["num_processes"] == runs["nproc"]
        assert len(theirs["records"]) == len(ours["records"])
        for i, (a, b) in enumerate(zip(ours["records"], theirs["records"])):
            assert (a["epoch"], a["batch"]) == (b["epoch"], b["batch"])
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), f"rank {r}, micro-step {i}: loss"
            assert a["lr"] == pytest.approx(b["lr"], abs=1e-6), f"rank {r}, micro-step {i}: learning rate"
        for a, b in zip(ours["evals"], theirs["evals"]):
            assert a["count"] == b["count"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert ours["after"] == pytest.approx(theirs["after"], abs=0)  # the same global random stream
