"""The training loop: accumulation, no_sync, clipping, scheduler rule, seeding, helpers, exact resume.

Multi-process checks run through `hasten launch` (2 gloo processes): one launch for the loop
checks (scripts/loop_checks.py) and two for the 2-process exact resume (scripts/loop_resume.py).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hasten.utils
from hasten import Accelerator, GradScalerKwargs
from hasten.distributed.processes import split_between_processes
from hasten.training.rng import capture_rng_state, restore_rng_state, set_seed
from launch_utils import SCRIPTS, launch, launch_env, read_ranks

LAUNCH_TIMEOUT = 240
# Two processes need two GPUs under NCCL; otherwise they run on CPU (gloo).
TWO = ("--num_processes", "2", *(() if torch.cuda.device_count() >= 2 else ("--cpu",)))


# ---------------------------------------------------------------------- 2 processes: loop checks


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop_checks")
    proc = launch(*TWO, SCRIPTS / "loop_checks.py", out, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_ranks(out, 2)


def test_two_process_accumulation_all_reduces_only_on_sync_steps(checks):
    for res in checks:
        steps = res["accumulation"]["steps"]
        # 6 batches per process, 4 accumulation steps: sync on the 4th and (end of data) the 6th.
        assert [s["sync"] for s in steps] == [False, False, False, True, False, True]
        assert [s["end_of_dataloader"] for s in steps] == [False] * 5 + [True]
        assert [s["allreduces"] for s in steps] == [0, 0, 0, 1, 0, 1]
        # Before a sync each process holds its own gradients; after it, the same ones.
        assert [s["grads_equal_across_ranks"] for s in steps] == [False, False, False, True, False, True]
        assert [s["weights_changed"] for s in steps] == [False, False, False, True, False, True]
        assert res["accumulation"]["step"] == 2
        assert res["no_sync"] == {"inside": 0, "after": 1}


def test_two_process_accumulation_equals_one_big_batch(checks):
    for res in checks:
        assert res["accumulation"]["big_batch_max_diff"] < 1e-5


def test_two_process_clip_grad_norm_fp16(checks):
    for res in checks:
        c = res["clipping"]
        assert c["scale"] > 1  # gradients really were scaled
        assert c["unscale_error"] < 1e-6  # unscaled exactly once, before clipping
        assert math.isclose(c["norm"], c["manual_norm"], rel_tol=1e-6)  # total norm of unscaled grads
        assert c["again"] == c["norm"]  # a second call does not unscale again
        assert c["clipped_returned"] == c["norm"]  # returns the norm before clipping
        assert math.isclose(c["after_clip"], 0.01, rel_tol=1e-3)
        assert c["norm_same_everywhere"]  # the all-reduced gradients
        assert c["skipped"] is False
    assert checks[0]["clipping"]["norm"] == checks[1]["clipping"]["norm"]


def test_two_process_scheduler_steps_once_per_process_per_optimizer_step(checks):
    for res in checks:
        s = res["scheduler"]
        # 4 micro-steps per process, 2 accumulation steps: 2 optimizer steps; as in Accelerate the
        # scheduler steps once per process on each (2 x 2 = 4), never on the micro-steps.
        assert s["lrs"] == [1.0, 0.25, 0.25, 0.0625]
        assert s["last_epoch"] == 4 and s["step"] == 2


def test_two_process_local_sgd_averages_every_k_steps_and_at_the_end(checks):
    for res in checks:
        e = res["local_sgd"]
        assert e["diff"] < 1e-6, e  # the hand-written reference: local steps, averaged every 2 and at exit
        assert e["num_steps"] == 5
        assert e["grads_stay_local"]  # inside the block DDP does not all-reduce


def test_local_sgd_on_one_process_and_its_refusals():
    from hasten import FullyShardedDataParallelPlugin
    from hasten.training.local_sgd import LocalSGD

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    before = [p.clone() for p in model.parameters()]
    with LocalSGD(acc, model, local_sgd_steps=1) as sgd:
        sgd.step()
    assert not sgd.enabled and sgd.num_steps == 1  # one process: nothing to average
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="LocalSGD.local_sgd_steps must be >= 1, got 0"):
        LocalSGD(acc, model, local_sgd_steps=0)
    fsdp = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(NotImplementedError, match="LocalSGD runs on one process or with DDP"):
        LocalSGD(fsdp, model, local_sgd_steps=2)


def test_two_process_gather_of_a_tensor_that_requires_grad(checks):
    for res in checks:
        g = res["gather_requires_grad"]
        assert g == {"values": [6.0] * 3 + [12.0] * 3, "requires_grad": False}


def test_two_process_gather_for_metrics_drops_duplicates(checks):
    for res in checks:
        g = res["gather_for_metrics"]
        assert g["tensors"] == list(range(10))  # exactly the 10 samples, no duplicate
        assert g["objects"] == list(range(10))
        assert g["per_batch"] == [8, 2]


def test_two_process_pad_split_and_process_helpers(checks):
    r0, r1 = checks
    assert r0["pad"]["last"] == [[1, 1], [-1, -1]] and r1["pad"]["last"] == [[2, 2], [2, 2]]
    assert r0["pad"]["first"] == [[-1, -1], [1, 1]]
    assert r0["pad"]["gathered"] == [[1, 1], [0, 0], [2, 2], [2, 2]]
    assert r0["split"] == {"list": [0, 1, 2], "padded": [0, 1, 2], "dict": {"a": [0, 1], "b": ["x", "y"]}}
    assert r1["split"] == {"list": [3, 4], "padded": [3, 4, 4], "dict": {"a": [2, 3], "b": ["z", "w"]}}
    # The main process ran the block first (saw no marker); the other ran it after (saw it).
    assert r0["main_process_first_saw_marker"] is False and r1["main_process_first_saw_marker"] is True
    assert r0["on_main_process"] == 0 and r1["on_main_process"] is None


def test_two_process_skip_first_batches(checks):
    r0, r1 = checks
    assert r0["skip_first_batches"] == {"skipped": [[4, 5]], "next_epoch": [[0, 1], [4, 5]]}
    assert r1["skip_first_batches"] == {"skipped": [[6, 7]], "next_epoch": [[2, 3], [6, 7]]}


# ---------------------------------------------------------------------- exact resume


def _run_resume(out, nproc: int, save_at: tuple[int, int]) -> None:
    for phase in (["first", *map(str, save_at)], ["resume"]):
        if nproc == 1:  # a plain fresh interpreter, no launcher
            cmd = [sys.executable, str(SCRIPTS / "loop_resume.py"), str(out), *phase]
            proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        else:
            proc = launch(*TWO, SCRIPTS / "loop_resume.py", out, *phase, timeout=LAUNCH_TIMEOUT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


# 1 process: 9 batches per epoch; 2 processes: 5 per process. Save after batch 4 / 2 of epoch 1,
# both the end of an accumulation cycle, in the middle of the epoch.
@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def resume(request, tmp_path_factory):
    nproc = request.param
    out = tmp_path_factory.mktemp(f"resume{nproc}")
    save_at = (1, 4) if nproc == 1 else (1, 2)
    _run_resume(out, nproc, save_at)
    ranks = []
    for r in range(nproc):
        first = json.loads((out / f"first_rank{r}.json").read_text())
        resumed = json.loads((out / f"resume_rank{r}.json").read_text())
        ranks.append({**first, **resumed})
    return {"out": out, "nproc": nproc, "save_at": save_at, "ranks": ranks}


def _plain(records):
    return [{k: v for k, v in r.items() if k != "saved"} for r in records]


def _same(a, b):
    """Records equal, NaN (a skipped step's norm) included."""
    return json.dumps(a) == json.dumps(b)


def test_resume_losses_lr_scale_match_step_by_step(resume):
    for res in resume["ranks"]:
        straight = _plain(res["straight"]["records"])
        stopped, resumed = res["stopped"]["records"], res["resumed"]["records"]
        assert stopped[-1]["epoch"] == 1 and stopped[-1]["batch"] == resume["save_at"][1]
        assert resumed[0]["epoch"] == 1 and resumed[0]["batch"] == resume["save_at"][1] + 1
        assert len(stopped) + len(resumed) == len(straight)
        for i, (a, b) in enumerate(zip(straight, _plain(stopped) + _plain(resumed))):
            assert _same(a, b), f"micro-step {i}: straight {a} vs stopped+resumed {b}"
        # The run exercised what a checkpoint must restore.
        after = straight[len(stopped) :]
        assert any(r["skipped"] for r in straight[: len(stopped)]) and any(r["skipped"] for r in after)
        assert len({r["scale"] for r in after}) > 1 and len({r["lr"] for r in after}) > 1
        assert any(not r["sync"] for r in after) and {r["epoch"] for r in straight} == {0, 1, 2}


def test_saving_does_not_change_the_run(resume):
    for r, res in enumerate(resume["ranks"]):
        assert _same(_plain(res["straight"]["records"]), _plain(res["continued"]["records"]))
        a = torch.load(resume["out"] / f"straight_rank{r}.pt")
        b = torch.load(resume["out"] / f"continued_rank{r}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_weights_bit_identical(resume):
    for r in range(resume["nproc"]):
        a = torch.load(resume["out"] / f"straight_rank{r}.pt")
        b = torch.load(resume["out"] / f"resumed_rank{r}.pt")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_resume_restores_counters_scaler_scheduler_loader_and_custom_objects(resume):
    for res in resume["ranks"]:
        saved = res["stopped"]["records"][-1]["saved"]
        loaded = res["resumed"]["loaded"]
        for key in ("step", "lr", "scale", "tracker", "real_steps"):
            assert loaded[key] == saved[key], key
        for key in ("epoch", "batches_yielded", "seed"):
            assert loaded["loader"][key] == saved["loader"][key], key
        assert saved["step"] > saved["real_steps"] > 0  # step counts fp16-skipped steps too
        assert loaded["tracker"] == resume["ranks"][0]["resumed"]["loaded"]["tracker"]  # same everywhere


def test_two_process_checkpoint_at_one_process(resume, tmp_path):
    if resume["nproc"] != 2:
        pytest.skip("needs the 2-process checkpoint")
    sys.path.insert(0, str(SCRIPTS))
    from loop_common import build, make_accelerator

    accelerator = make_accelerator()
    model, *_ = build(accelerator)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) but this run has 1.*strict_world_size=True"):
        accelerator.load_state(resume["out"] / "ckpt", strict_world_size=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded
    ckpt = resume["out"] / "ckpt"
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
    accelerator.load_state(ckpt)  # by default a resize loads (tests/test_resize.py checks the positions)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------- one process, in-process


def _loader(n: int, batch_size: int, **kw) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)), batch_size=batch_size, **kw
    )


def test_accumulate_sync_pattern_and_no_op_steps():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(10, 2))  # 5 batches
    syncs, ends, changed, grad_kept = [], [], [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            before = model.weight.detach().clone()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            grad = model.weight.grad.clone()
            optimizer.step()
            optimizer.zero_grad()
            changed.append(not torch.equal(before, model.weight))
            grad_kept.append(model.weight.grad is not None and torch.equal(model.weight.grad, grad))
        syncs.append(accelerator.sync_gradients)
        ends.append(accelerator.gradient_state.end_of_dataloader)
    assert syncs == [False, True, False, True, True]  # the end of the data forces a sync
    assert ends == [False, False, False, False, True]
    assert changed == syncs  # optimizer.step() is a no-op between syncs
    assert grad_kept == [not s for s in syncs]  # so is zero_grad(): gradients accumulate
    assert accelerator.step == 3 and optimizer.real_steps == 3
    assert accelerator.gradient_state.end_of_dataloader is False  # reset after the loop


def test_leaving_the_loop_early_resets_end_of_dataloader():
    accelerator = Accelerator(gradient_accumulation_steps=4)
    loader = accelerator.prepare(_loader(4, 2))
    for _ in loader:
        pass
    it = iter(loader)
    next(it)
    next(it)  # the last batch: end_of_dataloader is set while it is in use
    assert accelerator.gradient_state.end_of_dataloader is True
    del it  # leaving the loop (break) closes the iterator
    assert accelerator.gradient_state.end_of_dataloader is False
    assert accelerator.gradient_state.advance() is False  # a later micro-step does not force a sync


def test_an_inner_loop_gives_the_outer_loop_its_end_of_data_back():
    """Evaluating inside the last training batch must not make that batch look like any other."""
    accelerator = Accelerator(gradient_accumulation_steps=4)
    train, evaluate = accelerator.prepare(_loader(6, 2), _loader(4, 2))
    seen = []
    for _i, _ in enumerate(train):
        inner = [accelerator.gradient_state.end_of_dataloader for _ in evaluate]
        assert inner == [False, True]  # the evaluation loop's own end
        seen.append(accelerator.gradient_state.end_of_dataloader)
        with accelerator.accumulate():
            pass
        seen.append(accelerator.sync_gradients)
    assert seen == [False, False, False, False, True, True]  # the last batch still ends the data: a sync
    assert accelerator.gradient_state.end_of_dataloader is False


def test_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    data = _loader(8, 8)
    x, y = next(iter(data))
    torch.nn.functional.mse_loss(reference(x), y).backward()

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(reference.state_dict())
    model, loader = accelerator.prepare(model, _loader(8, 2))
    for bx, by in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(bx), by))
    assert accelerator.sync_gradients
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_scheduler_skips_micro_steps_and_skipped_fp16_steps():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, sched = accelerator.prepare(model, optimizer, sched)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    lrs, skipped = [], []
    for i in range(4):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i == 1:
            loss = loss * float("inf")  # inf gradients: the scaler skips this step
        accelerator.backward(loss)
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        skipped.append(accelerator.optimizer_step_was_skipped)
    assert skipped == [False, True, False, False]
    assert lrs == [0.5, 0.5, 0.25, 0.125]
    assert accelerator.step == 4 and optimizer.real_steps == 3
    assert accelerator.scaler.get_scale() == 4.0  # backed off once


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_scheduler_not_tied_to_optimizer_steps_when_asked():
    accelerator = Accelerator(gradient_accumulation_steps=2, step_scheduler_with_optimizer=False)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, sched, loader = accelerator.prepare(model, optimizer, sched, _loader(8, 2))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            sched.step()
    assert sched.last_epoch == 4 and optimizer.real_steps == 2


def test_clip_grad_norm_fp16_unscales_once_and_returns_total_norm():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(torch.nn.functional.mse_loss(model(torch.randn(5, 4)), torch.randn(5, 2)))
    scaled = [p.grad.clone() for p in model.parameters()]
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6)
    unscaled = [p.grad.clone() for p in model.parameters()]
    for s, u in zip(scaled, unscaled):
        torch.testing.assert_close(s / 1024.0, u)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(u) for u in unscaled]))
    torch.testing.assert_close(norm, expected)
    assert accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6) == norm  # no second unscale
    accelerator.clip_grad_value_(model.parameters(), clip_value=1e-4)
    assert all(p.grad.abs().max() <= 1e-4 for p in model.parameters())
    optimizer.step()  # the scaler does not unscale again (it would raise)
    assert not accelerator.optimizer_step_was_skipped and optimizer.real_steps == 1


def test_unscale_gradients_once_per_step():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=64.0)])
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):  # the once-per-step bookkeeping resets at each step
        accelerator.backward(model(torch.ones(1, 4)).sum())
        scaled = model.weight.grad.clone()
        accelerator.unscale_gradients()
        accelerator.unscale_gradients()
        torch.testing.assert_close(model.weight.grad, scaled / accelerator.scaler.get_scale())
        optimizer.step()
        optimizer.zero_grad()


def test_clip_grad_norm_fp32_matches_torch():
    accelerator = Accelerator()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    a = accelerator.prepare(a)
    x = torch.randn(3, 4)
    a(x).pow(2).sum().backward()
    b(x).pow(2).sum().backward()
    got = accelerator.clip_grad_norm_(a.parameters(), 0.5, norm_type=1.0)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5, norm_type=1.0)
    assert torch.equal(got, want) and torch.equal(a.weight.grad, b.weight.grad)


# ---------------------------------------------------------------------- seeding and RNG states


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_set_seed_seeds_python_numpy_torch():
    assert hasten.utils.set_seed is set_seed
    set_seed(42)
    first = _draws()
    set_seed(42)
    assert _draws() == first
    set_seed(43)
    assert _draws() != first


def test_set_seed_device_specific_adds_the_rank(monkeypatch):
    set_seed(100)
    base = _draws()
    monkeypatch.setenv("RANK", "3")
    assert set_seed(97, device_specific=True) == 100
    assert _draws() == base
    assert set_seed(97) == 97


@pytest.mark.parametrize(
    "seed, device_specific, error",
    [
        (-1, False, ValueError),
        (2**32, False, ValueError),
        (1.5, False, TypeError),
        (True, False, TypeError),
        ("1", False, TypeError),
        (1, "yes", TypeError),
    ],
)
def test_set_seed_rejects_bad_input(seed, device_specific, error):
    with pytest.raises(error, match="set_seed"):
        set_seed(seed, device_specific)


def test_rng_state_round_trip_through_torch_save(tmp_path):
    set_seed(5)
    state = capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = _draws()
    _draws()
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == expected


def test_rng_restore_failures_are_errors(monkeypatch):
    good = capture_rng_state()
    with pytest.raises(RuntimeError, match="holds no RNG states"):
        restore_rng_state({"torch": good["torch"]})
    with pytest.raises(RuntimeError, match="holds no NumPy state"):
        restore_rng_state({k: v for k, v in good.items() if k != "numpy"})
    with pytest.raises(RuntimeError, match="CUDA device"):
        restore_rng_state({**good, "cuda": [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)})
    with pytest.raises(RuntimeError, match="cannot restore RNG states"):
        restore_rng_state({**good, "torch": torch.zeros(3)})
    import hasten.training.rng

    monkeypatch.setattr(hasten.training.rng, "_numpy", lambda: None)
    with pytest.raises(RuntimeError, match="NumPy is not installed"):
        restore_rng_state(good)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_states_are_captured_and_restored():
    set_seed(9)
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda").tolist()
    torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected


# ---------------------------------------------------------------------- helpers on one process


def test_split_between_processes_shares():
    parts = [split_between_processes(list(range(7)), 3, r) for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [split_between_processes(list(range(7)), 3, r, apply_padding=True) for r in range(3)]
    assert padded == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]
    t = split_between_processes(torch.arange(5), 2, 1)
    assert t.tolist() == [3, 4]
    assert split_between_processes({"a": [1, 2], "b": (3, 4)}, 2, 0) == {"a": [1], "b": (3,)}
    with pytest.raises(TypeError, match="split_between_processes"):
        split_between_processes(5, 2, 0)
    accelerator = Accelerator()
    with accelerator.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def test_process_helpers_on_one_process():
    accelerator = Accelerator()
    ran = []
    with accelerator.main_process_first():
        ran.append("block")

    @accelerator.on_main_process
    def f(x):
        """doc"""
        return x * 2

    assert ran == ["block"] and f(3) == 6 and f.__doc__ == "doc"
    data = torch.arange(5)
    assert torch.equal(accelerator.gather_for_metrics(data), data)
    assert torch.equal(accelerator.pad_across_processes(data), data)


def test_skip_first_batches_one_process():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    assert [b.tolist() for (b,) in accelerator.skip_first_batches(loader, 3)] == [[6, 7], [8, 9]]
    assert [b.tolist() for (b,) in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # only once
    with pytest.raises(TypeError, match="prepare"):
        accelerator.skip_first_batches(DataLoader(TensorDataset(torch.arange(4))), 1)


def test_dataloader_position_resumes_mid_epoch_with_same_order():
    def epochs(loader, n):
        return [[b.tolist() for (b,) in loader] for _ in range(n)]

    set_seed(0)
    straight = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    reference = epochs(straight, 3)
    assert reference[0] != reference[1]  # shuffled differently each epoch

    set_seed(0)
    first = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    epochs(first, 1)
    it = iter(first)
    got = [next(it)[0].tolist(), next(it)[0].tolist()]
    state, rng = first.state_dict(), capture_rng_state()  # what save_state keeps
    del it

    set_seed(1)  # a different process: the order comes from the state
    second = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    second.load_state_dict(state)
    assert second.state_dict()["epoch"] == 1 and second.state_dict()["batches_yielded"] == 2
    third = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    third.load_state_dict(second.state_dict())  # saving again before iterating keeps the position
    restore_rng_state(rng)  # as load_state does after the loaders
    rest = [b.tolist() for (b,) in third]
    assert got + rest == reference[1]
    assert epochs(third, 1) == [reference[2]]

    # Saved at the end of an epoch: loader.epoch after loading is the next epoch to run.
    fourth = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    fourth.load_state_dict(third.state_dict())
    assert fourth.epoch == 3 and fourth.state_dict()["batches_yielded"] == 0
    sixth = Accelerator().prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    sixth.load_state_dict(state | {"batches_yielded": 4})  # the whole of epoch 1 was seen
    restore_rng_state(rng)  # (where the global generator stood after epoch 1's rest: no draw in between)
    assert sixth.epoch == 2 and epochs(sixth, 1) == [reference[2]]
