"""Accelerate's gradient accumulation example for autoregressive models, on a tiny
LlamaForCausalLM: on 2 processes it runs (gather_for_metrics of a loss that still requires
grad) and trains to the weights one process reaches on the same global batches (issue 28)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch_utils import SCRIPTS, launch, launch_env, read_ranks

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hasten[transformers]')")

SCRIPT = SCRIPTS / "causal_lm_accumulation.py"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.mark.slow  # > 20 s: make test-slow
def test_two_processes_accumulate_gather_a_grad_requiring_loss_and_match_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    ref = subprocess.run(
        [sys.executable, str(SCRIPT), str(one)], env=launch_env(**ENV), capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    proc = launch("--cpu", "--num_processes", "2", SCRIPT, two, env=launch_env(**ENV), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = json.loads((one / "rank0.json").read_text())
    ranks = read_ranks(two, 2)
    for rank in ranks:
        assert rank["requires_grad"] == [False] * 4  # the gathered copies are detached
        assert [len(g) for g in rank["losses"]] == [8] * 4  # 4 sequences from each process per micro-batch
        assert rank["losses"] == ranks[0]["losses"]  # every process holds the same gathered losses
    # the mean of the gathered per-process losses is the one-process loss of the same global batch
    for mine, ref_losses in zip(ranks[0]["losses"], single["losses"]):
        assert sum(mine) / len(mine) == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-5, abs=1e-6)
    # and the weights after 2 optimizer steps (4 micro-batches, accumulation 2) are one process's
    for name, value in single["sums"].items():
        assert ranks[0]["sums"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
