"""The main job with a tiny budget, through the launcher: it trains, checkpoints, resumes, plots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_utils import launch, launch_env

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (pip install 'hasten[demo]')")

SCRIPT = Path(__file__).parent.parent / "examples" / "train_digits.py"
EPOCH_LINE = re.compile(r"epoch\s+(\d+)/(\d+)\s+loss ([\d.]+)\s+test accuracy ([\d.]+)\s+([\d,]+) samples/s")


def _epochs(stdout: str) -> list[tuple[int, float, float]]:
    return [(int(m[1]), float(m[3]), float(m[4])) for m in EPOCH_LINE.finditer(stdout)]


def test_demo_trains_checkpoints_and_resumes(tmp_path):
    project = tmp_path / "run"
    common = ["--max_steps_per_epoch", "8", "--project_dir", str(project), "--no_progress"]
    first = launch("--num_processes", "2", SCRIPT, "--epochs", "2", *common, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    epochs = _epochs(first.stdout)
    assert [e[0] for e in epochs] == [1, 2]  # one summary line per epoch, from the main process only
    assert all(0.0 <= acc <= 1.0 and loss > 0 for _, loss, acc in epochs)
    assert epochs[-1][2] > 0.2  # better than chance after 16 optimizer micro-steps
    result = json.loads((project / "result.json").read_text())
    assert result["epochs"] == 2 and result["num_processes"] == 2 and result["mixed_precision"] == "bf16"
    assert Path(result["checkpoint"]).is_dir()
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    traces = sorted(p.name for p in (project / "profile").iterdir())
    assert any("rank0" in t for t in traces) and any("rank1" in t for t in traces)
    png = (project / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "final test accuracy" in first.stdout

    # Resume through `hasten demo` itself: one more epoch after the two saved ones.
    second = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "demo", "--epochs", "3", "--resume", *common],
        env=launch_env(), capture_output=True, text=True, timeout=300,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert "resumed from" in second.stdout and "checkpoint_1" in second.stdout
    assert [e[0] for e in _epochs(second.stdout)] == [3]
    resumed = json.loads((project / "result.json").read_text())
    assert resumed["epochs"] == 3
    # total_limit=2 keeps the newest two
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
