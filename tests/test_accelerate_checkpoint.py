"""load_state reads Accelerate's save_state folders (issue 21, item 5).

A folder in Accelerate's layout is written here by hand (the file names and contents
Accelerate's ``save_accelerator_state`` writes), so the test runs without Accelerate; where
Accelerate is installed, a folder written by Accelerate itself is loaded too.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import pytest
import torch

from hasten import Accelerator
from hasten.training.rng import set_seed


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _objects(mixed_precision="fp16", seed=0):
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps=3):
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _write_accelerate_folder(path, model, opt, sched, counter, scaler_state=None, step=5):
    """What Accelerate 1.x's save_state writes on one process (model as safetensors)."""
    import safetensors.torch

    os.makedirs(path)
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    torch.save(opt.state_dict(), os.path.join(path, "optimizer.bin"))
    torch.save(sched.state_dict(), os.path.join(path, "scheduler.bin"))
    if scaler_state is not None:
        torch.save(scaler_state, os.path.join(path, "scaler.pt"))
    torch.save(counter.state_dict(), os.path.join(path, "custom_checkpoint_0.pkl"))
    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(states, os.path.join(path, "random_states_0.pkl"))


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_an_accelerate_folder_restores_weights_optimizer_scheduler_scaler_rng_and_objects(tmp_path):
    model, opt, sched = _objects()
    _train(model, opt, sched)
    path = tmp_path / "checkpoint_0"
    scaler_state = {
        "scale": 512.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 7,
    }
    _write_accelerate_folder(path, model, opt, sched, Counter(42), scaler_state, step=5)
    expected = _draws()  # what the saved RNG states draw next

    acc = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    fresh, fresh_opt, fresh_sched = _objects(seed=1)
    counter = Counter()
    fresh, fresh_opt, fresh_sched = acc.prepare(fresh, fresh_opt, fresh_sched)
    acc.register_for_checkpointing(counter)
    assert acc.load_state(path) == str(path)
    assert _draws() == expected
    for a, b in zip(model.state_dict().values(), acc.unwrap_model(fresh).state_dict().values()):
        assert torch.equal(a, b)
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"][0]["lr"] == loaded["param_groups"][0]["lr"]
    for k, s in saved["state"].items():
        assert torch.equal(s["exp_avg"], loaded["state"][k]["exp_avg"]) and float(s["step"]) == float(
            loaded["state"][k]["step"]
        )
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    assert acc.scaler.get_scale() == 512.0
    assert counter.value == 42
    assert acc.gradient_state.micro_step == 1  # Accelerate's step 5 with accumulation 2
    assert acc.checkpoint_state.directory == str(path)


def test_load_state_finds_the_newest_accelerate_checkpoint_in_project_dir(tmp_path):
    model, opt, sched = _objects()
    for n in (0, 1):
        _train(model, opt, sched, 1)
        _write_accelerate_folder(tmp_path / "checkpoints" / f"checkpoint_{n}", model, opt, sched, Counter(n))
    acc = Accelerator(project_dir=tmp_path)
    acc.prepare(*_objects(seed=3))  # the objects load_state fills
    counter = Counter()
    acc.register_for_checkpointing(counter)
    assert acc.load_state().endswith("checkpoint_1") and counter.value == 1


def test_a_pickled_object_in_an_accelerate_file_is_refused_and_changes_nothing(tmp_path):
    model, opt, sched = _objects(mixed_precision="no")
    path = tmp_path / "ckpt"
    _write_accelerate_folder(path, model, opt, sched, Counter(1))
    torch.save({"value": argparse.Namespace(x=1)}, path / "custom_checkpoint_0.pkl")
    acc = Accelerator()
    fresh, fresh_opt, fresh_sched = acc.prepare(*_objects(seed=2))
    counter = Counter(9)
    acc.register_for_checkpointing(counter)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot read 'custom_checkpoint_0.pkl'.*objects other than tensors"):
        acc.load_state(path)
    assert counter.value == 9 and all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_an_accelerate_folder_of_another_world_size_or_precision_is_refused(tmp_path):
    model, opt, sched = _objects()
    path = tmp_path / "ckpt"
    _write_accelerate_folder(path, model, opt, sched, Counter())
    torch.save(torch.load(path / "random_states_0.pkl", weights_only=False), path / "random_states_1.pkl")
    acc = Accelerator()
    acc.prepare(*_objects())
    acc.register_for_checkpointing(Counter())
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\).*this run has 1"):
        acc.load_state(path, strict_world_size=True)
    rng = torch.get_rng_state()
    acc.load_state(path)  # at another size: everything but the per-process random states
    assert torch.equal(torch.get_rng_state(), rng)
    os.remove(path / "random_states_1.pkl")
    fp16 = Accelerator(mixed_precision="fp16")
    fp16.prepare(*_objects())
    fp16.register_for_checkpointing(Counter())
    with pytest.raises(ValueError, match=r"saved without a GradScaler.*mixed_precision='fp16' with one"):
        fp16.load_state(path)


def test_a_folder_written_by_accelerate_itself(tmp_path):
    accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed (an optional test dependency)")
    acc_a = accelerate.Accelerator(cpu=True)
    model, opt, sched = acc_a.prepare(*_objects())
    counter = Counter(7)
    acc_a.register_for_checkpointing(counter)
    x = torch.randn(8, 4)
    for _ in range(2):
        acc_a.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    acc_a.save_state(str(tmp_path / "ckpt"))
    expected = _draws()
    weights = {k: v.clone() for k, v in acc_a.unwrap_model(model).state_dict().items()}
    lr = sched.get_last_lr()

    acc = Accelerator()
    fresh, fresh_opt, fresh_sched = acc.prepare(*_objects(seed=5))
    mine = Counter()
    acc.register_for_checkpointing(mine)
    acc.load_state(tmp_path / "ckpt")
    assert _draws() == expected and mine.value == 7 and fresh_sched.get_last_lr() == lr
    assert all(torch.equal(weights[k], v) for k, v in acc.unwrap_model(fresh).state_dict().items())
