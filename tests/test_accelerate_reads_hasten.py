"""Accelerate's own ``load_state`` resumes a folder hasten's ``save_state`` wrote (issue 58: "the reverse").

The "full" layout writes Accelerate's file names and forms (``checkpoint.layouts.names``): a run
saved by hasten (one process in this process; DDP on 2 processes through ``hasten launch``) is
loaded in a fresh process by the real Accelerate, without ``install_as_accelerate()``, into new
objects, and the weights, optimizer and scheduler states, RNG states, registered objects, GradScaler
and accumulation counter are compared with what the saving run had. hasten keeps reading its own
folders, those written before the names changed too (``names.HASTEN``, no ``file_names`` field).

This file is also the script the processes run: ``python tests/test_accelerate_reads_hasten.py
(save-ddp | load) ...`` (``_main``); its modes import only what they use (the loading one: torch and
the real ``accelerate``, never hasten).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve()


class Counter:
    """A registered object (``register_for_checkpointing``)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _objects(n: int, seed: int) -> tuple[list, list, list]:
    """``n`` models of different shapes, an AdamW and a StepLR for each."""
    torch.manual_seed(seed)
    models = [
        torch.nn.Sequential(torch.nn.Linear(4, 6 + i), torch.nn.ReLU(), torch.nn.Linear(6 + i, 2)) for i in range(n)
    ]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01 * (i + 1)) for i, m in enumerate(models)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    return models, opts, scheds


def _draws() -> list[Any]:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


def _state(acc: Any, models: list, opts: list, scheds: list, counters: list) -> dict[str, Any]:
    """What a resumed run must have, the same under hasten and Accelerate (RNG draws last: they move the states)."""
    return {
        "weights": [{k: v.detach().clone() for k, v in acc.unwrap_model(m).state_dict().items()} for m in models],
        "optimizers": [o.state_dict() for o in opts],
        "schedulers": [s.state_dict() for s in scheds],
        "counters": [c.value for c in counters],
        "scale": None if acc.scaler is None else acc.scaler.get_scale(),
        "draws": _draws(),
    }


def _train(acc: Any, models: list, opts: list, scheds: list, micro_steps: int) -> None:
    for _ in range(micro_steps):
        with acc.accumulate(*models):
            for m, o, s in zip(models, opts, scheds):
                acc.backward(m(torch.randn(8, 4, device=acc.device)).pow(2).mean())
                o.step()
                s.step()
                o.zero_grad()


def _save_with_hasten(ck: Path, n: int = 1, *, safe: bool = True, fp16: bool = False) -> dict:
    """A hasten run in this process: trained 3 micro-steps (accumulation 2: saved in mid-cycle, micro-step 1)."""
    from hasten import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2, mixed_precision="fp16" if fp16 else "no")
    models, opts, scheds = _objects(n, seed=0)
    prepared = acc.prepare(*models, *opts, *scheds)
    prepared = list(prepared) if isinstance(prepared, tuple) else [prepared]
    models, opts, scheds = prepared[:n], prepared[n : 2 * n], prepared[2 * n :]
    counters = [Counter(7 + i) for i in range(n)]
    acc.register_for_checkpointing(*counters)
    _train(acc, models, opts, scheds, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saved in mid-cycle on purpose
        acc.save_state(ck, safe_serialization=safe)
    return {**_state(acc, models, opts, scheds, counters), "micro_step": acc.gradient_state.micro_step}


# ---------------------------------------------------------------------- the script's modes


def _save_ddp(out: Path) -> None:
    """Under ``hasten launch --num_processes 2``: DDP, saved at out/ck; each rank's expectations to out."""
    from hasten import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2)
    models, opts, scheds = _objects(1, seed=0)
    model, opt, sched = acc.prepare(models[0], opts[0], scheds[0])
    counter = Counter(11)
    acc.register_for_checkpointing(counter)
    torch.manual_seed(100 + acc.process_index)  # each rank's own RNG states
    _train(acc, [model], [opt], [sched], 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.save_state(out / "ck")
    expected = {**_state(acc, [model], [opt], [sched], [counter]), "micro_step": acc.gradient_state.micro_step}
    expected["wrapped"] = type(model).__name__
    torch.save(expected, out / f"expected_{acc.process_index}.pt")
    acc.end_training()


def _load_with_accelerate(ck: str, n: int = 1, fp16: bool = False) -> None:
    """Real Accelerate (no installer): fresh objects prepared, ``load_state(ck)``, their state to
    ck/../loaded_{rank}.pt."""
    import accelerate

    assert "hasten" not in (accelerate.__file__ or ""), accelerate.__file__
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    if fp16:  # Accelerate has no GradScaler on the CPU: one of its own, to read scaler.pt into
        acc.scaler = torch.amp.GradScaler("cpu")
    models, opts, scheds = _objects(n, seed=5)
    prepared = acc.prepare(*models, *opts, *scheds)
    prepared = list(prepared) if isinstance(prepared, tuple) else [prepared]
    models, opts, scheds = prepared[:n], prepared[n : 2 * n], prepared[2 * n :]
    counters = [Counter() for _ in range(n)]
    acc.register_for_checkpointing(*counters)
    acc.load_state(ck)
    loaded = {**_state(acc, models, opts, scheds, counters), "step": acc.step, "wrapped": type(models[0]).__name__}
    torch.save(loaded, Path(ck).parent / f"loaded_{acc.process_index}.pt")


def _main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "save-ddp":
        _save_ddp(Path(args[0]))
    elif mode == "load":  # each argument: the JSON of one load's keyword arguments (one interpreter start for all)
        for job in args:
            _load_with_accelerate(**json.loads(job))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


# ---------------------------------------------------------------------- the tests

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="Accelerate is not installed (an optional test dependency)"
)


def _accelerate_loads(*jobs: dict[str, Any], processes: int = 1) -> list[list[dict]]:
    """Run the "load" mode for each of ``jobs`` (``_load_with_accelerate``'s arguments, ``ck`` a
    folder of its own) in one plain Python (no installer), or in ``processes`` under torchrun;
    each job's loaded states, per process."""
    from launch_utils import free_port, launch_env

    cmd = [sys.executable, str(HERE), "load", *(json.dumps({**j, "ck": str(j["ck"])}) for j in jobs)]
    if processes > 1:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        cmd = [*run, "--master_port", str(free_port()), *cmd[1:]]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [
        [torch.load(Path(j["ck"]).parent / f"loaded_{r}.pt", weights_only=False) for r in range(processes)]
        for j in jobs
    ]


def _assert_same(saved: dict, loaded: dict) -> None:
    assert len(saved["weights"]) == len(loaded["weights"])
    for mine, theirs in zip(saved["weights"], loaded["weights"]):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for mine, theirs in zip(saved["optimizers"], loaded["optimizers"], strict=True):
        assert mine["param_groups"] == theirs["param_groups"]
        assert mine["state"].keys() == theirs["state"].keys()
        for p, entry in mine["state"].items():
            assert all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(theirs["state"][p][k])) for k, v in entry.items()
            )
    assert saved["schedulers"] == loaded["schedulers"]
    assert saved["counters"] == loaded["counters"]
    assert saved["draws"] == loaded["draws"]  # Python, NumPy and torch generators where the save left them
    assert loaded["step"] == saved["micro_step"]  # Accelerate's accumulation counter: the cycle goes on


@needs_accelerate
def test_accelerate_resumes_one_process_folders_hasten_wrote(tmp_path):
    """safetensors and torch .bin weights; two models (and two of everything) with a GradScaler."""
    folders = {name: tmp_path / name / "ck" for name in ("safetensors", "bin", "several")}
    saved = {
        "safetensors": _save_with_hasten(folders["safetensors"]),
        "bin": _save_with_hasten(folders["bin"], safe=False),
        "several": _save_with_hasten(folders["several"], n=2, fp16=True),
    }
    for name, model_file in (("safetensors", "model.safetensors"), ("bin", "pytorch_model.bin")):
        assert sorted(os.listdir(folders[name])) == sorted(
            [model_file, "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"]
            + ["loop_state.json", "hasten_checkpoint.json"]
        )  # Accelerate's names, each file once
    listed = set(os.listdir(folders["several"]))
    assert {"model.safetensors", "model_1.safetensors", "optimizer_1.bin", "scheduler_1.bin", "scaler.pt"} <= listed
    assert {"custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"} <= listed
    manifest = json.loads((folders["several"] / "hasten_checkpoint.json").read_text())
    assert manifest["file_names"] == "accelerate" and [m["file"] for m in manifest["models"]] == [
        "model.safetensors",
        "model_1.safetensors",
    ]
    assert torch.load(folders["several"] / "scaler.pt", weights_only=True)["scale"] == saved["several"]["scale"]

    jobs = [{"ck": folders["safetensors"]}, {"ck": folders["bin"]}]
    jobs.append({"ck": folders["several"], "n": 2, "fp16": True})
    loaded = dict(zip(folders, (per_process[0] for per_process in _accelerate_loads(*jobs))))
    for name in folders:
        assert saved[name]["micro_step"] == 1  # saved in mid-cycle: Accelerate's step goes on from it
        _assert_same(saved[name], loaded[name])
    assert loaded["several"]["scale"] == saved["several"]["scale"]


def test_hasten_resumes_its_folder_in_accelerates_names(tmp_path):
    """Two of everything and a GradScaler (scaler.pt in Accelerate's form: the GradScaler's own state dict)."""
    from hasten import Accelerator

    saved = _save_with_hasten(tmp_path / "ck", n=2, fp16=True)
    assert torch.load(tmp_path / "ck" / "scaler.pt", weights_only=True)["scale"] == saved["scale"]
    acc = Accelerator(gradient_accumulation_steps=2, mixed_precision="fp16")
    models, opts, scheds = _objects(2, seed=3)
    prepared = acc.prepare(*models, *opts, *scheds)
    counters = [Counter(), Counter()]
    acc.register_for_checkpointing(*counters)
    acc.load_state(tmp_path / "ck")
    loaded = _state(acc, prepared[:2], prepared[2:4], prepared[4:], counters)
    _assert_same(saved, {**loaded, "step": acc.gradient_state.micro_step})
    assert loaded["scale"] == saved["scale"]


def _old_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict]:
    """A folder as hasten wrote it before it used Accelerate's names (hasten's names, no ``file_names``)."""
    from hasten.checkpoint.layouts import full, names

    ck = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(full.LAYOUT, "file_names", names.HASTEN)
        saved = _save_with_hasten(ck, fp16=True)
    manifest_path = ck / "hasten_checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("file_names") == "hasten"
    manifest_path.write_text(json.dumps(manifest))
    return ck, saved


def test_hasten_still_reads_its_folders_of_earlier_versions(tmp_path, monkeypatch):
    from hasten import Accelerator

    ck, saved = _old_folder(tmp_path, monkeypatch)
    listed = {"model_0.safetensors", "optimizer_0.pt", "scheduler_0.pt", "custom_0.pt", "scaler.pt", "rank_0.pt"}
    assert listed <= set(os.listdir(ck)) and not any(n.endswith((".pkl", ".bin")) for n in os.listdir(ck))
    assert torch.load(ck / "scaler.pt", weights_only=True)["scaler"]["scale"] == saved["scale"]  # hasten's old form
    acc = Accelerator(gradient_accumulation_steps=2, mixed_precision="fp16")
    models, opts, scheds = _objects(1, seed=3)
    model, opt, sched = acc.prepare(models[0], opts[0], scheds[0])
    counter = Counter()
    acc.register_for_checkpointing(counter)
    acc.load_state(ck)
    loaded = {**_state(acc, [model], [opt], [sched], [counter]), "step": acc.gradient_state.micro_step}
    _assert_same(saved, loaded)
    assert loaded["scale"] == saved["scale"]


def test_a_manifest_naming_unknown_file_names_is_refused(tmp_path):
    from hasten import Accelerator

    _save_with_hasten(tmp_path / "ck")
    path = tmp_path / "ck" / "hasten_checkpoint.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "file_names": "megatron"}))
    acc = Accelerator(gradient_accumulation_steps=2)
    models, opts, scheds = _objects(1, seed=3)
    model, *_ = acc.prepare(models[0], opts[0], scheds[0])
    acc.register_for_checkpointing(Counter())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"file_names is 'megatron'; it must be one of 'accelerate', 'hasten'"):
        acc.load_state(tmp_path / "ck")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("also_removed", [(), ("loop_state.json",)], ids=["manifest", "manifest-and-loop-state"])
def test_a_hasten_folder_without_its_manifest_never_passes_for_an_accelerate_one(tmp_path, also_removed):
    """It has Accelerate's names (random_states_0.pkl included), but it is a save that did not finish."""
    from hasten import Accelerator

    _save_with_hasten(tmp_path / "ck")
    for name in ("hasten_checkpoint.json", *also_removed):
        os.remove(tmp_path / "ck" / name)
    acc = Accelerator(gradient_accumulation_steps=2)
    models, opts, scheds = _objects(1, seed=3)
    model, *_ = acc.prepare(models[0], opts[0], scheds[0])
    acc.register_for_checkpointing(Counter())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"has no hasten_checkpoint.json, so it is not a complete hasten checkpoint"):
        acc.load_state(tmp_path / "ck")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_models_can_be_assigned_as_in_accelerate(tmp_path):
    """``accelerator._models = [...]`` (a plain list in Accelerate): the same list refilled, which save_state reads."""
    from hasten import Accelerator

    acc = Accelerator()
    models, opts, _ = _objects(2, seed=0)
    first, second = acc.prepare(*models)
    registry = acc._models
    acc._models = [second]
    assert acc._models is registry and registry == [second]
    acc.save_state(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "hasten_checkpoint.json").read_text())
    assert [sorted(m["tensors"]) for m in manifest["models"]] == [sorted(second.state_dict())]
    assert manifest["models"][0]["tensors"]["0.weight"]["shape"] == [7, 4]  # the second model's
    with pytest.raises(TypeError, match=r"Accelerator._models takes a list of torch.nn.Module, got a str"):
        acc._models = "model"
    with pytest.raises(TypeError, match=r"item 1 is a int"):
        acc._models = [first, 3]
    assert acc._models == [second]


@needs_accelerate
@pytest.mark.slow
def test_accelerate_resumes_a_ddp_folder_hasten_wrote_on_two_processes(tmp_path):
    """Saved by hasten's DDP on 2 processes, resumed by Accelerate's DDP on 2 (torchrun): each process
    its own RNG states (random_states_0.pkl, random_states_1.pkl)."""
    from launch_utils import launch

    proc = launch("--num_processes", "2", "--cpu", HERE, "save-ddp", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    names = set(os.listdir(tmp_path / "ck"))
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"} <= names
    manifest = json.loads((tmp_path / "ck" / "hasten_checkpoint.json").read_text())
    assert manifest["world_size"] == 2 and manifest["file_names"] == "accelerate"
    (loaded,) = _accelerate_loads({"ck": tmp_path / "ck"}, processes=2)
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"expected_{rank}.pt", weights_only=False)
        assert saved["wrapped"] == loaded[rank]["wrapped"] == "DistributedDataParallel"
        _assert_same(saved, loaded[rank])
    assert loaded[0]["draws"] != loaded[1]["draws"]  # each process got its own states back


if __name__ == "__main__":
    _main(sys.argv[1:])
