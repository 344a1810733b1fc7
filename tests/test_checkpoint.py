"""Checkpoints on one process: contents, manifest, atomicity, refusals, total_limit, save_model, save.

The exact resume across fresh processes (1 and 2 processes) is in test_loop.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hasten.checkpoint.checksums as ckpt_checksums
import hasten.checkpoint.files as ckpt_files
from hasten import Accelerator, GradScalerKwargs
from hasten.checkpoint import load_model, parse_size, read_manifest
from hasten.training.rng import set_seed
from launch_utils import launch_env


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _visible(folder) -> list[str]:
    """The folder's entries without hidden ones."""
    return sorted(e for e in os.listdir(folder) if not e.startswith("."))


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def make(project_dir=None, mixed_precision="fp16", model=None, accumulation=1):
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        project_dir=project_dir,
        gradient_accumulation_steps=accumulation,
        kwargs_handlers=[GradScalerKwargs(init_scale=128.0, growth_interval=1)],
    )
    set_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.2), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = TensorDataset(torch.randn(20, 4), torch.randn(20, 2))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, scheduler, counter


def train_steps(accelerator, model, optimizer, loader, scheduler, counter, n):
    it = iter(loader)
    for _ in range(n):
        x, y = next(it)
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.value += 1
    return it


def snapshot(accelerator, model, optimizer, loader, scheduler, counter):
    return {
        "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "adam_step": [s["step"].item() for s in optimizer.state_dict()["state"].values()],
        "lr": scheduler.get_last_lr(),
        "scale": accelerator.scaler.get_scale() if accelerator.scaler else None,
        "step": accelerator.step,
        "real_steps": optimizer.real_steps,
        "loader": {k: v for k, v in loader.state_dict().items()},
        "counter": counter.value,
    }


def assert_same(a, b):
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    for key in ("adam_step", "lr", "scale", "step", "real_steps", "counter"):
        assert a[key] == b[key], key
    for key in ("epoch", "batches_yielded", "seed"):
        assert a["loader"][key] == b["loader"][key], key
    # The generator states the interrupted epoch started from (to draw its order again).
    ra, rb = a["loader"]["rng"], b["loader"]["rng"]
    assert ra.keys() == rb.keys()
    for key in ra:
        x, y = ra[key], rb[key]
        if isinstance(x, list):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), key
        else:
            assert (x is None and y is None) or torch.equal(x, y), key


# ---------------------------------------------------------------------- contents and layout


def test_save_and_load_restore_everything(tmp_path):
    objs = make()
    it = train_steps(*objs, 5)
    saved = snapshot(*objs)
    assert saved["loader"]["rng"]["iterator"] is not None  # mid-epoch: where its order was drawn from
    path = objs[0].save_state(tmp_path / "ckpt")
    assert path == str(tmp_path / "ckpt")
    next_batch = next(it)[0]
    rng_after = torch.rand(3)
    del it

    fresh = make()
    assert fresh[0].load_state(tmp_path / "ckpt") == path
    assert_same(saved, snapshot(*fresh))
    assert torch.equal(next(iter(fresh[3]))[0], next_batch)  # the dataloader continues the epoch
    fresh[0].load_state(tmp_path / "ckpt")
    assert torch.equal(torch.rand(3), rng_after)  # RNG restored
    assert fresh[0].checkpoint_state.directory == path and fresh[0].checkpoint_state.iteration is None


def test_layout_and_manifest(tmp_path):
    objs = make()
    train_steps(*objs, 2)
    path = objs[0].save_state(tmp_path / "ckpt")
    names = sorted(os.listdir(path))
    assert names == sorted(
        [
            "model.safetensors",
            "optimizer.bin",
            "scheduler.bin",
            "custom_checkpoint_0.pkl",
            "scaler.pt",
            "loop_state.json",
            "random_states_0.pkl",
            "hasten_checkpoint.json",
        ]
    )
    manifest = read_manifest(path)
    assert manifest["world_size"] == 1 and manifest["torch_version"] == torch.__version__
    assert manifest["hasten_version"] and manifest["mixed_precision"] == "fp16" and manifest["scaler"] is True
    assert manifest["counts"] == {"models": 1, "optimizers": 1, "schedulers": 1, "dataloaders": 1, "custom_objects": 1}
    assert manifest["models"][0]["tensors"]["0.weight"] == {"shape": [6, 4], "dtype": "float32"}
    assert set(manifest["files"]) == set(names) - {"hasten_checkpoint.json"}
    for name, record in manifest["files"].items():
        assert record == ckpt_checksums.record(os.path.join(path, name))  # sizes and XXH3-128
    loop = json.loads(_read(os.path.join(path, "loop_state.json")))
    assert loop == {
        "step": 2,
        "global_batch": 2,
        "micro_step": 0,
        "optimizers": [{"real_steps": objs[2].real_steps, "sync_steps": 2}],
    }
    # The model file is plain safetensors holding the unwrapped weights.
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in objs[1].state_dict().items())


def test_torch_bin_weights_without_safetensors_serialization(tmp_path):
    objs = make(mixed_precision="no")
    path = objs[0].save_state(tmp_path / "ckpt", safe_serialization=False)
    assert os.path.isfile(os.path.join(path, "pytorch_model.bin")) and not os.path.exists(
        os.path.join(path, "scaler.pt")
    )
    make(mixed_precision="no")[0].load_state(path)


def test_missing_safetensors_is_a_clear_error(tmp_path, monkeypatch):
    objs = make()
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"hasten\[checkpoint\].*safe_serialization=False"):
        objs[0].save_state(tmp_path / "ckpt")
    assert not os.path.exists(tmp_path / "ckpt")


def test_tied_weights_round_trip(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(x)

    objs = make(model=Tied())
    objs[1].emb.weight.data.add_(1.0)
    path = objs[0].save_state(tmp_path / "ckpt")
    fresh = make(model=Tied())
    fresh[0].load_state(path)
    assert torch.equal(fresh[1].emb.weight, objs[1].emb.weight)
    assert fresh[1].head.weight is fresh[1].emb.weight


def test_warns_when_saving_in_the_middle_of_accumulation(tmp_path):
    objs = make(accumulation=2)
    train_steps(*objs, 1)
    with pytest.warns(UserWarning, match="middle of a gradient accumulation cycle"):
        objs[0].save_state(tmp_path / "ckpt")
    fresh = make(accumulation=2)
    fresh[0].load_state(tmp_path / "ckpt")
    assert fresh[0].gradient_state.micro_step == 1  # the cycle position is kept


# ---------------------------------------------------------------------- automatic naming, total_limit


def test_automatic_naming_total_limit_and_latest(tmp_path):
    objs = make(project_dir=tmp_path)
    root = tmp_path / "checkpoints"
    steps = []
    for i in range(4):
        train_steps(*objs, 1)
        path = objs[0].save_state(total_limit=2)
        assert path == str(root / f"checkpoint_{i}") and objs[0].checkpoint_state.iteration == i
        steps.append(objs[0].step)
    assert _visible(root) == ["checkpoint_2", "checkpoint_3"]  # the oldest went
    assert os.listdir(tmp_path) == ["checkpoints"]  # the lock is inside it (Accelerate's tests count this)
    fresh = make(project_dir=tmp_path)
    assert fresh[0].load_state() == str(root / "checkpoint_3") and fresh[0].step == steps[3]
    assert fresh[0].checkpoint_state.iteration == 3
    assert fresh[0].save_state(total_limit=1) == str(root / "checkpoint_4")  # never overwrites
    assert _visible(root) == ["checkpoint_4"]  # the newest is kept


def test_automatic_naming_needs_project_dir_and_total_limit_needs_it():
    accelerator = make()[0]
    with pytest.raises(ValueError, match="project_dir"):
        accelerator.save_state()
    with pytest.raises(ValueError, match="project_dir"):
        accelerator.load_state()
    with pytest.raises(ValueError, match="total_limit"):
        accelerator.save_state("somewhere", total_limit=2)


@pytest.mark.parametrize("value, error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_total_limit(tmp_path, value, error):
    with pytest.raises(error, match="total_limit"):
        make(project_dir=tmp_path)[0].save_state(total_limit=value)


def test_load_latest_without_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint_N"):
        make(project_dir=tmp_path)[0].load_state()


def test_resume_or_start_with_missing_ok(tmp_path):
    objs = make(project_dir=tmp_path)
    accelerator = objs[0]
    before = snapshot(*objs)
    assert accelerator.load_state(missing_ok=True) is None  # nothing yet: start fresh, nothing changed
    assert_same(before, snapshot(*objs))
    train_steps(*objs, 2)
    accelerator.save_state()
    (tmp_path / "checkpoints" / "checkpoint_1").mkdir()  # half-written (no manifest): passed over
    again = make(project_dir=tmp_path)
    assert again[0].load_state(missing_ok=True) == str(tmp_path / "checkpoints" / "checkpoint_0")
    assert_same(snapshot(*objs), snapshot(*again))
    with pytest.raises(ValueError, match=r"missing_ok=True\) looks for the newest checkpoint of project_dir"):
        again[0].load_state(tmp_path / "checkpoints" / "checkpoint_0", missing_ok=True)
    with pytest.raises(TypeError, match="missing_ok"):
        again[0].load_state(missing_ok="yes")


# ---------------------------------------------------------------------- atomicity


def test_failed_save_leaves_previous_checkpoint_and_nothing_else(tmp_path, monkeypatch):
    objs = make()
    train_steps(*objs, 2)
    path = objs[0].save_state(tmp_path / "ckpt")
    before = {n: _read(os.path.join(path, n)) for n in os.listdir(path)}
    train_steps(*objs, 2)
    real = ckpt_files.write_json

    def crash(p, obj):
        if p.endswith("hasten_checkpoint.json"):
            raise OSError("disk full")
        real(p, obj)

    monkeypatch.setattr(ckpt_files, "write_json", crash)  # fails while writing the manifest
    with pytest.raises(OSError, match="disk full"):
        objs[0].save_state(tmp_path / "ckpt")
    monkeypatch.setattr(ckpt_files, "write_json", real)
    assert {n: _read(os.path.join(path, n)) for n in os.listdir(path)} == before
    assert os.listdir(tmp_path) == ["ckpt"]  # the temporary directory is gone


def test_a_killed_save_is_never_accepted(tmp_path):
    """A process killed in the middle of save_state: the old checkpoint loads, the half one does not."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import make, train_steps
        import hasten.checkpoint.files as ckpt_files
        objs = make(project_dir={str(tmp_path)!r})
        train_steps(*objs, 1)
        objs[0].save_state()
        real = ckpt_files.write
        def die(path, write):
            real(path, write)
            if path.endswith("scheduler.bin"):
                os._exit(3)  # like a kill -9 in the middle of the save
        ckpt_files.write = die
        objs[0].save_state()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    root = tmp_path / "checkpoints"
    leftovers = [n for n in os.listdir(root) if n.startswith(".") and n != ".hasten-lock"]
    assert [n for n in os.listdir(root) if not n.startswith(".")] == ["checkpoint_0"]  # no checkpoint_1
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint_1.tmp-")
    accelerator = make(project_dir=tmp_path)[0]
    with pytest.raises(ValueError, match="not a complete hasten checkpoint"):
        accelerator.load_state(root / leftovers[0])
    assert accelerator.load_state() == str(root / "checkpoint_0")
    assert accelerator.save_state() == str(root / "checkpoint_1")
    assert (
        _visible(root) == ["checkpoint_0", "checkpoint_1"] and sorted(os.listdir(root))[0] == ".hasten-lock"
    )  # the crash's leftovers are cleaned


def test_overwrite_existing_checkpoint_but_not_a_foreign_directory(tmp_path):
    objs = make()
    objs[0].save_state(tmp_path / "ckpt")
    train_steps(*objs, 3)
    objs[0].save_state(tmp_path / "ckpt")
    assert read_manifest(tmp_path / "ckpt")["step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a hasten checkpoint; refusing"):
        objs[0].save_state(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------- refusals (never a partial load)


@pytest.fixture
def saved(tmp_path):
    objs = make()
    train_steps(*objs, 3)
    return objs[0].save_state(tmp_path / "ckpt")


def _refuses(path, match, error=ValueError, load_kwargs=None, **make_kwargs):
    objs = make(**make_kwargs)
    before = snapshot(*objs)
    with pytest.raises(error, match=match):
        objs[0].load_state(path, **(load_kwargs or {}))
    assert_same(before, snapshot(*objs))  # nothing was restored


def test_refuses_directory_without_manifest(saved):
    os.remove(os.path.join(saved, "hasten_checkpoint.json"))
    _refuses(saved, "not a complete hasten checkpoint")


def test_refuses_broken_manifest(saved):
    _write(os.path.join(saved, "hasten_checkpoint.json"), b"{not json")
    _refuses(saved, "manifest .* cannot be read")


def test_refuses_missing_file(saved):
    os.remove(os.path.join(saved, "optimizer.bin"))
    _refuses(saved, "incomplete: 'optimizer.bin' is missing")


def test_refuses_truncated_file(saved):
    path = os.path.join(saved, "model.safetensors")
    _write(path, _read(path)[:-8])
    _refuses(saved, "damaged: 'model.safetensors' has")


def test_refuses_changed_bytes(saved):
    path = os.path.join(saved, "model.safetensors")
    data = bytearray(_read(path))
    data[-1] ^= 0xFF
    _write(path, bytes(data))
    _refuses(saved, "does not match its checksum")


def test_refuses_other_world_size(saved):
    path = os.path.join(saved, "hasten_checkpoint.json")
    manifest = json.loads(_read(path))
    manifest["world_size"] = 2
    _write(path, json.dumps(manifest).encode())
    _refuses(
        saved,
        r"saved by 2 process\(es\) but this run has 1.*strict_world_size=True",
        load_kwargs={"strict_world_size": True},
    )


def test_refuses_incompatible_model(saved):
    other = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Dropout(0.2), torch.nn.Linear(7, 2))
    _refuses(
        saved,
        r"does not fit the prepared model: different shapes: 0.weight: checkpoint \[6, 4\] vs model \[7, 4\]",
        model=other,
    )
    renamed = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    _refuses(saved, "missing from the checkpoint: 1.weight", model=renamed)


def test_refuses_other_objects_and_precision(saved):
    objs = make()
    objs[0].register_for_checkpointing(Counter())
    with pytest.raises(ValueError, match="custom_objects: checkpoint 1 vs prepared 2"):
        objs[0].load_state(saved)
    _refuses(saved, "with a GradScaler, but this Accelerator has mixed_precision='no'", mixed_precision="no")


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    class Odd:
        def state_dict(self):
            return {"when": Counter(3)}

        def load_state_dict(self, state):
            self.loaded = state

    objs = make()
    objs[0].register_for_checkpointing(Odd())
    objs[0].save_state(tmp_path / "ckpt")
    fresh = make()
    odd = Odd()
    fresh[0].register_for_checkpointing(odd)
    with pytest.raises(ValueError, match="weights_only=False"):
        fresh[0].load_state(tmp_path / "ckpt")
    fresh[0].load_state(tmp_path / "ckpt", weights_only=False)
    assert odd.loaded["when"].value == 3


def test_register_for_checkpointing_needs_state_dict_methods():
    accelerator = Accelerator()
    with pytest.raises(ValueError, match=r"Item at index 1 \(int\)"):  # ValueError, as in Accelerate
        accelerator.register_for_checkpointing(Counter(), 5)
    assert accelerator._custom_objects == []


# ---------------------------------------------------------------------- save_model / load_model / save


def test_save_model_single_and_sharded(tmp_path):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    paths = accelerator.save_model(model, tmp_path / "one")
    assert [os.path.basename(p) for p in paths] == ["model.safetensors"]
    paths = accelerator.save_model(model, tmp_path / "many", max_shard_size="10KB")  # 16.6 KB of weights
    assert [os.path.basename(p) for p in paths] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads(_read(tmp_path / "many" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    for folder in ("one", "many"):
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        load_model(fresh, tmp_path / folder)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # Saving again unsharded into the sharded folder removes the old shards and index.
    accelerator.save_model(model, tmp_path / "many")
    assert sorted(os.listdir(tmp_path / "many")) == ["model.safetensors"]
    with pytest.raises(ValueError, match="different shapes"):
        load_model(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)), tmp_path / "one")


def test_save_model_torch_format(tmp_path):
    accelerator = Accelerator()
    model = torch.nn.Linear(3, 2)
    paths = accelerator.save_model(model, tmp_path, safe_serialization=False)
    assert [os.path.basename(p) for p in paths] == ["pytorch_model.bin"]
    fresh = torch.nn.Linear(3, 2)
    load_model(fresh, tmp_path)
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize(
    "value, expected", [(100, 100), ("10GB", 10**10), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1.5KB", 1500)]
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value, error", [("lots", ValueError), (0, ValueError), ("-1GB", ValueError), (True, ValueError), (1.5, ValueError)]
)
def test_parse_size_rejects(value, error):
    with pytest.raises(error, match="max_shard_size"):
        parse_size(value)


def test_save_model_rejects_bad_input(tmp_path):
    accelerator = Accelerator()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        accelerator.save_model({"w": torch.ones(1)}, tmp_path)
    with pytest.raises(TypeError, match="save_directory"):
        accelerator.save_model(torch.nn.Linear(1, 1), 3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="must be a directory"):
        accelerator.save_model(torch.nn.Linear(1, 1), tmp_path / "file")


def test_save_writes_atomically(tmp_path, monkeypatch):
    accelerator = Accelerator()
    target = tmp_path / "sub" / "obj.pt"
    accelerator.save({"a": torch.arange(3)}, target)
    assert torch.equal(torch.load(target)["a"], torch.arange(3))

    def boom(obj, f):
        f.write(b"partial")
        raise RuntimeError("crash while writing")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(RuntimeError, match="crash while writing"):
        accelerator.save({"a": torch.zeros(3)}, target)
    monkeypatch.undo()
    assert torch.equal(torch.load(target)["a"], torch.arange(3))  # the old file is intact
    assert os.listdir(target.parent) == ["obj.pt"]  # no temporary file left
    accelerator.save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))
    with pytest.raises(TypeError, match="save.f"):
        accelerator.save({}, 3)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset without a length."""

    def __iter__(self):
        return iter(torch.arange(10, dtype=torch.float32).reshape(10, 1))


def test_iterable_dataset_without_length_resumes(tmp_path):
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(Stream(), batch_size=3))
    it = iter(loader)
    next(it)
    accelerator.save_state(tmp_path / "ckpt")
    del it
    fresh = Accelerator()
    fresh_loader = fresh.prepare(DataLoader(Stream(), batch_size=3))
    fresh.load_state(tmp_path / "ckpt")
    assert [b.flatten().tolist() for b in fresh_loader] == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]
