"""Parameters kept whole over tensor parallelism's ranks on activations TP split: Qwen3's per-head
``q_norm``/``k_norm``. With the heads split, each TP rank's gradient of such a norm is its heads'
part only; summed over ``tp`` (transformers' style ``replicated_with_grad_allreduce``) it is the
whole one. One 2-process launch (TP 2) of scripts/tp_norm_checks.py: Qwen3's own plan (eager and
compiled with ``aot_eager``) and a
hand-written plan naming the style train as one process does (weights to ~1e-6 after 3 SGD steps
at lr 0.5, fp32); a hand-written plan that forgets the norms is refused at the first optimizer
step, naming them, with the weights unchanged (it used to train on silently wrong gradients)."""

from __future__ import annotations

import pytest

from hasten import ParallelismConfig
from launch_utils import SCRIPTS, launch, read_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tpn")
    proc = launch("--num_processes", "2", SCRIPTS / "tp_norm_checks.py", out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_ranks(out, 2)


@pytest.mark.parametrize("case", ["own_plan", "own_plan_compiled", "hand_plan_summed"])
def test_norms_on_split_heads_train_as_one_process(ranks, case):
    for r in ranks:
        got = r[case]
        assert "error" not in got and "refused" not in got, got
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=1e-5)
    assert ranks[0][case]["weight_diff"] < 1e-5


def test_a_plan_that_forgets_them_is_refused_before_any_step(ranks):
    for r in ranks:
        got = r["hand_plan_missing"]
        assert "error" not in got, got
        message = got["refused"]
        assert "model.layers.0.self_attn.q_norm.weight" in message and "differ between the tp ranks" in message
        assert "'model.layers.*.self_attn.q_norm': 'replicated_with_grad_allreduce'" in message
        assert got["losses"] == [] and got["refused_again"] is True
    assert ranks[0]["hand_plan_missing"]["unchanged"] is True


def test_the_style_is_accepted_in_a_plan_and_needs_parameters():
    pc = ParallelismConfig(tp_size=2, tp_plan={"layers.*.norm": "replicated_with_grad_allreduce"})
    assert pc.tp_plan == {"layers.*.norm": "replicated_with_grad_allreduce"}
    import torch

    from hasten.strategies.tensor_parallel import resolve

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(
        ValueError, match=r"tp_plan\['1'\] = 'replicated_with_grad_allreduce' matches '1', a ReLU without param"
    ):
        resolve(model, {"1": "replicated_with_grad_allreduce"}, "tp_plan")
