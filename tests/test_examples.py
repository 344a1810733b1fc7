"""Every example the README shows is a file under examples/ that runs here (short settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import torchrun
from launch_utils import launch_env

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_quickstart_one_process():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--epochs", "2", "--mixed_precision", "fp16"],
        capture_output=True, text=True, timeout=120, env=launch_env(),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("epoch")]
    assert len(lines) == 2 and "on 1 process(es)" in lines[0]
    first, last = (float(l.split("loss ")[1].split()[0]) for l in (lines[0], lines[-1]))
    assert last < first  # it learns


def test_quickstart_two_processes():
    proc = torchrun(EXAMPLES / "quickstart.py", "--epochs", "2", "--mixed_precision", "bf16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("epoch")]
    assert len(lines) == 2 and "on 2 process(es)" in lines[0]  # printed by the main process only


def test_fsdp_example_two_processes(tmp_path):
    import json

    proc = torchrun(EXAMPLES / "fsdp.py", "--steps", "60", "--checkpoint", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step")]
    assert len(lines) == 3 and "(FSDP, 2 process(es))" in lines[0]
    first, last = (float(l.split("loss ")[1].split()[0]) for l in (lines[0], lines[-1]))
    assert last < first  # it learns
    assert json.loads((tmp_path / "ck" / "hasten_checkpoint.json").read_text())["layout"] == "dcp"
