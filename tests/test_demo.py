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
    common = ["--max_steps_per_epoch", "12", "--project_dir", str(project), "--no_progress"]
    first = launch("--num_processes", "2", SCRIPT, "--epochs", "2", *common, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    epochs = _epochs(first.stdout)
    assert [e[0] for e in epochs] == [1, 2]  # one summary line per epoch, from the main process only
    assert all(0.0 <= acc <= 1.0 and loss > 0 for _, loss, acc in epochs)
    assert epochs[-1][2] > 0.2  # better than chance after 24 micro-steps
    result = json.loads((project / "result.json").read_text())
    assert result["epochs"] == 2 and result["num_processes"] == 2 and result["mixed_precision"] == "bf16"
    assert Path(result["checkpoint"]).is_dir()
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == [
        ".hasten-lock",
        "checkpoint_0",
        "checkpoint_1",
    ]
    traces = sorted(p.name for p in (project / "profile").iterdir())
    assert any("rank0" in t for t in traces) and any("rank1" in t for t in traces)
    png = (project / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "final test accuracy" in first.stdout

    # Resume through `hasten demo` itself: one more epoch after the two saved ones.
    second = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "demo", "--epochs", "3", "--resume", *common],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert "resumed from" in second.stdout and "checkpoint_1" in second.stdout
    assert [e[0] for e in _epochs(second.stdout)] == [3]
    resumed = json.loads((project / "result.json").read_text())
    assert resumed["epochs"] == 3
    # total_limit=2 keeps the newest two
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == [
        ".hasten-lock",
        "checkpoint_1",
        "checkpoint_2",
    ]


def _demo(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hasten.cli", "demo", *args], cwd=cwd, env=launch_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow  # > 20 s: make test-slow
def test_readme_sequence_demo_fp16_demo_then_resume_with_more_epochs(tmp_path):
    """README: `hasten demo`, `hasten demo --mixed_precision fp16`, `hasten demo`, `hasten demo --epochs
    15 --resume` (short epochs here). Each configuration has its own folder and each run without --resume
    a new run-<k> in it (checkpoint numbers start again, TensorBoard curves apart), so the resume continues
    the newest bf16 run; it has more epochs than that run, so its schedule is rebuilt for the new length.
    The progress bar shows the throughput meter's samples/s, FLOP/s and peak memory."""
    short = ["--max_steps_per_epoch", "10"]
    first = _demo("--epochs", "2", *short, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    run1 = tmp_path / "runs" / "digits" / "bf16-2proc" / "run-1"
    # paths as the user would write them (relative to where the demo ran), TensorBoard named
    assert "checkpoint: runs/digits/bf16-2proc/run-1/checkpoints/checkpoint_1" in first.stdout
    assert "tensorboard --logdir runs/digits/bf16-2proc/run-1" in first.stdout and str(tmp_path) not in first.stdout
    assert list((run1 / "tensorboard").glob("events.out.tfevents.*"))
    # the bar (tqdm, on stderr) with the meter's figures: the CNN's FLOPs are known, the CPU's peak is not
    bars = [line for line in first.stderr.replace("\r", "\n").splitlines() if "samples/s" in line]
    assert bars and all(re.search(r"[\d,]+ samples/s  [\d.]+ GFLOP/s  peak mem [\d,]+ MiB", b) for b in bars), bars
    assert "MFU" not in first.stderr
    # the profiler recorded one full cycle: 5 steps on each rank
    for rank in range(2):
        trace = json.loads((run1 / "profile" / f"trace_rank{rank}_cycle1.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert len(steps) == 5, steps

    short.append("--no_progress")
    fp16 = _demo("--mixed_precision", "fp16", "--epochs", "1", *short, cwd=tmp_path)
    assert fp16.returncode == 0, fp16.stdout[-2000:] + fp16.stderr[-4000:]
    assert (tmp_path / "runs" / "digits" / "fp16-2proc" / "run-1" / "checkpoints" / "checkpoint_0").is_dir()

    # the same configuration again, without --resume: a new run folder, checkpoints from 0, run-1 untouched
    again = _demo("--epochs", "1", *short, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    assert "checkpoint: runs/digits/bf16-2proc/run-2/checkpoints/checkpoint_0" in again.stdout
    assert sorted(p.name for p in (run1 / "checkpoints").iterdir()) == [".hasten-lock", "checkpoint_0", "checkpoint_1"]
    assert len(list((run1 / "tensorboard").glob("events.out.tfevents.*"))) == 1

    resumed = _demo("--epochs", "3", "--resume", *short, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "resumed from runs/digits/bf16-2proc/run-2/checkpoints/checkpoint_0 (1 epoch(s) done)" in resumed.stdout
    assert [e[0] for e in _epochs(resumed.stdout)] == [2, 3]
    assert "Tried to step" not in resumed.stderr and "Traceback" not in resumed.stderr
    lrs = [float(x) for x in re.findall(r"lr ([\d.e+-]+)", resumed.stdout)]
    assert lrs[0] > lrs[1] > 0  # the rebuilt schedule anneals to its new end
    assert json.loads((run1.parent / "run-2" / "result.json").read_text())["epochs"] == 3
    assert json.loads((run1 / "result.json").read_text())["epochs"] == 2
    # the meter's figures reached TensorBoard through compute_and_log, once per epoch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run1 / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"samples_per_sec", "device/samples_per_sec", "flops_per_sec", "device/peak_memory_gib"} <= set(tags)
    assert len(events.Scalars("flops_per_sec")) == 2 and events.Scalars("flops_per_sec")[0].value > 0

    # A mismatched resume into a given folder: one refusal, before any process, naming the flag.
    refused = _demo(
        "--mixed_precision", "fp16", "--resume", "--project_dir", "runs/digits/bf16-2proc/run-2",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "hasten demo: error: --resume: runs/digits/bf16-2proc/run-2/checkpoints/checkpoint_2 was saved with "
        "--mixed_precision bf16, this run asks for fp16; add --mixed_precision bf16 to continue it (or leave out "
        "--project_dir: each precision has its own run folder)"
    ], refused.stderr
    assert "hasten launch" not in refused.stderr  # no worker started


def test_demo_flags_are_parsed_before_any_worker_starts(tmp_path):
    helped = _demo("--help", cwd=tmp_path, timeout=120)
    assert helped.returncode == 0 and helped.stdout.count("usage: hasten demo") == 1
    for flag in (
        "--num_processes",
        "--epochs",
        "--mixed_precision",
        "--resume",
        "--project_dir",
        "--max_steps_per_epoch",
    ):
        assert flag in helped.stdout
    script_help = _demo("--script-help", cwd=tmp_path, timeout=120)
    assert script_help.returncode == 0 and script_help.stdout == helped.stdout  # once, from the parent
    typo = _demo("--epoch", "3", cwd=tmp_path, timeout=120)
    assert typo.returncode == 2 and "unknown option --epoch; did you mean --epochs?" in typo.stderr
    assert "hasten launch" not in typo.stderr and not (tmp_path / "runs").exists()  # nothing started
    bad = _demo("--epochs", "0", cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "--epochs must be >= 1, got 0" in bad.stderr
    missing = _demo("--resume", cwd=tmp_path, timeout=120)
    assert (
        missing.returncode == 2
        and "--resume: there is no checkpoint in runs/digits/bf16-2proc yet; run once without --resume first"
        in missing.stderr
    )
    assert not (tmp_path / "runs").exists()  # a refused run makes no folder
