"""hasten inside Ray Train (issue 49): examples/ray_train.py run by a ``TorchTrainer`` with 2 CPU
workers. The Accelerator adopts the process group Ray made, each worker reads its share of the
data, and both of Ray's checkpoint patterns work: each worker saving into a temporary folder of
its own (Ray gathers the files into one checkpoint) and one folder every worker sees. Ray's
checkpoint loads at one process, and a second ``fit`` with the same name resumes from it.

The Ray runs are marked slow (a Ray cluster starts on 2 busy cores in ~20 s per run); ``make
test-slow`` installs the ``ray`` extra, and without Ray they skip, saying so. The refusal of
different folders outside Ray runs in ``make test``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ray_train.py"


def _ray() -> None:
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'hasten[ray]'; make test-slow)")


def _run(tmp_path: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--storage", str(tmp_path / "store"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _checkpoint(tmp_path: Path, name: str) -> Path:
    found = sorted((tmp_path / "store" / name).rglob("hasten_checkpoint.json"))
    assert found, f"no checkpoint under {tmp_path / 'store' / name}"
    return found[-1].parent


def _load_at_one_process(folder: Path, fsdp: bool) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from ray_train import dataset
    from torch import nn

    from hasten import Accelerator

    accelerator = Accelerator()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.load_state(str(folder))
    after = [p.detach() for p in model.parameters()]
    accelerator.end_training()
    return {"changed": any(not torch.equal(a, b) for a, b in zip(before, after))}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_each_worker_saves_into_its_own_folder_and_ray_assembles_one_checkpoint(tmp_path, fsdp):
    _ray()
    extra = ["--fsdp"] if fsdp else []
    first = _run(tmp_path, "--workers", "2", "--epochs", "2", "--name", "run", *extra)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    assert "final loss" in first.stdout
    folder = _checkpoint(tmp_path, "run")
    manifest = json.loads((folder / "hasten_checkpoint.json").read_text())
    assert manifest["world_size"] == 2
    assert (folder / "epoch.txt").read_text() == "1"
    assert _load_at_one_process(folder, fsdp)["changed"]
    again = _run(tmp_path, "--workers", "2", "--epochs", "3", "--name", "run", *extra)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-6000:]
    assert "after epoch 2" in again.stdout  # resumed from epoch 1's checkpoint: one epoch more


@pytest.mark.slow
def test_one_shared_folder_works_too(tmp_path):
    _ray()
    shared = tmp_path / "shared"
    proc = _run(tmp_path, "--workers", "2", "--epochs", "1", "--name", "shared", "--shared", str(shared))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (shared / "epoch_0" / "hasten_checkpoint.json").is_file()


def test_different_folders_outside_ray_are_refused_naming_each(tmp_path):
    """Without Ray Train, processes given different output_dirs are refused on every process, each
    folder named, before anything is written."""
    sys.path.insert(0, str(ROOT / "tests"))
    from launch_utils import launch

    script = tmp_path / "per_rank.py"
    script.write_text(
        "import os, sys, torch\n"
        "from hasten import Accelerator\n"
        "acc = Accelerator()\n"
        "model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))\n"
        "folder = os.path.join(sys.argv[1], f'own{acc.process_index}')\n"
        "try:\n"
        "    acc.save_state(folder)\n"
        "except ValueError as e:\n"
        "    open(os.path.join(sys.argv[1], f'said{acc.process_index}.txt'), 'w').write(str(e))\n"
    )
    proc = launch("--num_processes", "2", script, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in range(2):
        said = (tmp_path / f"said{rank}.txt").read_text()
        assert "process 0:" in said and "own0" in said and "process 1:" in said and "own1" in said
        assert "outside Ray Train every process must be given the same output_dir" in said
        assert not (tmp_path / f"own{rank}").exists()
