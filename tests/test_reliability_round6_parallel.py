"""Reliability, round 6 (issue 57): silent wrong training under TP, Ulysses SP, activation
checkpointing and EP.

One 2-process launch of scripts/round6_parallel_checks.py: tp 2 ranks fed different batches are
refused at the first forward on every rank, naming the tp group (they used to reach the gradient
check, whose advice trained silently wrong); tp 2 fed one batch trains as one process; every sp 2
misfeed (no buffers, a wrong buffer_seq_dims, a model input left out of the cut, nested splits,
different batches per sp rank, attention not exchanged, a padding mask on one rank's slice only)
is refused on every rank with the buffers whole again; EP with a rank holding no tokens trains as
one process holding every expert (it failed in the dispatch's reshape). In process: activation
checkpointing leaves BatchNorm's running statistics and a counter buffer as without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.settings.activation_checkpointing import ActivationCheckpointingConfig
from launch_utils import SCRIPTS, launch, read_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("r6par")
    proc = launch("--num_processes", "2", SCRIPTS / "round6_parallel_checks.py", out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return read_ranks(out, 2)


def _ok(result):
    assert "error" not in result, result["error"]
    return result


# ---------------------------------------------------------------------------- tensor parallelism
def test_tp_ranks_fed_one_batch_train_as_one_process(ranks):
    for r in ranks:
        assert len(_ok(r["tp_one_batch"])["losses"]) == 3
    assert ranks[0]["tp_one_batch"]["weight_diff"] < 1e-5


def test_tp_ranks_fed_different_batches_are_refused_first_on_every_rank(ranks):
    for r in ranks:
        got = _ok(r["tp_hand_split"])
        message = got.get("refused", "not refused")
        assert "the tp group [0, 1] got different inputs at the first forward of Sequential" in message, got
        assert "accelerator.prepare" in message and "replicated_with_grad_allreduce" not in message
        assert got["losses"] == []
    assert ranks[0]["tp_hand_split"]["unchanged"] is True


# ---------------------------------------------------------------------------- sequence parallelism
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("different_batches", "the processes of the sp group [0, 1] got different batches"),
        ("no_buffers", "got no buffers: nothing would be cut"),
        ("wrong_dims", "the model got 8 tokens per sequence (shape (1, 8)) where maybe_context_parallel cut"),
        ("input_not_cut", "the model got 8 tokens per sequence (shape (2, 8)) where maybe_context_parallel cut"),
        ("nested", "entered inside another maybe_context_parallel"),
        ("unrouted", "the forward of UnroutedLM inside maybe_context_parallel exchanged no attention"),
        ("padding_on_one_slice", "the attention_mask marks padding"),
    ],
)
def test_sp_misfeeds_are_refused_on_every_rank(ranks, case, words):
    for r in ranks:
        got = _ok(r[f"sp_{case}"])
        assert got["type"] == "ValueError" and words in got["message"], got
        assert got["shapes"] == [[2, 8], [2, 8]]  # the buffers hold their whole sequences again
    assert ranks[0][f"sp_{case}"]["message"] == ranks[1][f"sp_{case}"]["message"]


# ---------------------------------------------------------------------------- expert parallelism
def test_ep_with_a_rank_holding_no_tokens_trains_as_one_process(ranks):
    for r in ranks:
        got = _ok(r["ep_zero_tokens"])
        for out, ref in zip(got["outs"], got["ref_outs"]):
            assert out == pytest.approx(ref, abs=1e-5)
    assert ranks[0]["ep_zero_tokens"]["outs"][1] == [] and ranks[1]["ep_zero_tokens"]["outs"][0] == []
    assert ranks[0]["ep_zero_tokens"]["weight_diff"] < 1e-5


# ---------------------------------------------------------------------------- activation checkpointing
class Counted(nn.Module):
    """A block with BatchNorm and a counter buffer its forward increments."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, x):
        self.calls += 1
        return torch.relu(self.bn(self.lin(x) * self.scale))


def _trained(ac):
    torch.manual_seed(0)
    net = nn.Sequential(Counted(), Counted(), nn.Linear(8, 1))
    plugin = FullyShardedDataParallelPlugin(activation_checkpointing=ac) if ac is not None else None
    model = Accelerator(cpu=True, fsdp_plugin=plugin).prepare(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("ac", ["full", "selective", ActivationCheckpointingConfig(every_nth_block=1)])
def test_recomputation_leaves_buffers_as_without_checkpointing(ac):
    plain, checkpointed = _trained(None), _trained(ac)
    assert type(checkpointed[0]).__name__ == "CheckpointWrapper"
    want, got = plain.state_dict(), checkpointed.state_dict()
    assert sorted(want) == sorted(got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name  # running stats, num_batches_tracked, calls, weights
    assert int(got["0.calls"]) == 2 and int(got["0.bn.num_batches_tracked"]) == 2


def test_recomputation_leaves_buffers_with_the_offload_too():
    plain = _trained(None)
    torch.manual_seed(0)
    net = nn.Sequential(Counted(), Counted(), nn.Linear(8, 1))
    plugin = FullyShardedDataParallelPlugin(activation_checkpointing=True, activation_checkpointing_offload=True)
    model = Accelerator(cpu=True, fsdp_plugin=plugin).prepare(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
