"""Long-run health: a training run through `hasten launch` (2 gloo processes) stays flat.

After the warm-up each rank's resident memory grows by at most 5%, its open file descriptors
and threads do not grow, and when the launcher returns no process of the run is left and
nothing is left in its TMPDIR or among its checkpoints but the newest two.

The test runs SOAK_STEPS steps (600 by default); `make soak` runs the full 2,000.
"""

from __future__ import annotations

import json
import os

import psutil
import pytest
import torch

from launch_utils import SCRIPTS, launch, launch_env

STEPS = int(os.environ.get("SOAK_STEPS", "600"))
TWO = ("--num_processes", "2", *(() if torch.cuda.device_count() >= 2 else ("--cpu",)))


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    tmpdir = out / "tmp"
    tmpdir.mkdir()
    proc = launch(
        *TWO, SCRIPTS / "soak_train.py", out, STEPS,
        env=launch_env(TMPDIR=str(tmpdir)), timeout=240 + STEPS * 0.5,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, ranks


def test_the_run_went_the_distance(soak):
    _, ranks = soak
    for rec in ranks:
        assert rec["steps"] == STEPS and rec["epochs"] > 1  # several epochs of 32 steps
        assert len(rec["samples"]) >= 10 and rec["samples"][-1]["step"] == STEPS


def test_resident_memory_is_flat_after_warm_up(soak):
    _, ranks = soak
    for r, rec in enumerate(ranks):
        start = rec["samples"][0]["rss"]
        worst = max(s["rss"] for s in rec["samples"])
        assert worst <= 1.05 * start, f"rank {r}: RSS grew from {start} to {worst} bytes ({worst / start - 1:.1%})"


def test_no_file_descriptor_or_thread_growth(soak):
    _, ranks = soak
    for r, rec in enumerate(ranks):
        first = rec["samples"][0]
        assert max(s["fds"] for s in rec["samples"]) <= first["fds"], f"rank {r}: {[s['fds'] for s in rec['samples']]}"
        assert max(s["threads"] for s in rec["samples"]) <= first["threads"], (
            f"rank {r}: {[s['threads'] for s in rec['samples']]}"
        )


def test_nothing_is_left_behind(soak):
    out, ranks = soak
    _, alive = psutil.wait_procs([p for p in map(_process, (rec["pid"] for rec in ranks)) if p], timeout=10)
    assert alive == []
    mentioning = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert mentioning == [], "processes of the run are still alive"
    # torch.optim creates torch's compile cache folder (torchinductor_USER) in TMPDIR: a cache, kept on purpose.
    assert sorted(p.name for p in (out / "tmp").iterdir() if not p.name.startswith("torchinductor_")) == []
    assert sorted(os.listdir(out / "project" / "checkpoints")) == [".hasten-lock", *(f"checkpoint_{n}" for n in (6, 7))]


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
