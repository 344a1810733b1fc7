"""Pipeline parallelism's foundation, in one process: TorchPipelineParallelConfig and its checks,
the split plan, stages built by deleting what they do not own, and their names and outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hasten.settings.pipeline import (
    PIPELINE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    TorchPipelineParallelConfig,
    check_microbatches,
)
from hasten.strategies.pipeline_parallel.split import (
    SequentialStage,
    StageBlocks,
    build_stage,
    split_plan,
    stage_indices,
    stage_keys,
)

VOCAB, DIM, LAYERS = 32, 8, 8


# ------------------------------------------------------------------ tiny Llama-style models
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.silu(self.w1(self.ffn_norm(h))))


class TinyLlama(nn.Module):
    """torchtitan's contract: the forward skips the parts a stage lacks."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        blocks = [Block() for _ in range(LAYERS)]
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", torch.full((DIM,), 0.5))  # the model's own buffer: on every stage

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            h = layer(h) * self.scale
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class PlainModel(nn.Module):
    """A forward that does not skip anything: SequentialStage runs its stages."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        blocks = [Block() for _ in range(LAYERS)]
        self.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.RMSNorm(DIM)


class NestedLM(nn.Module):
    """Hugging Face's layout: the blocks at ``model.layers``, the head at the top."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(0))


def owners(stage: nn.Module) -> set[str]:
    """The modules (a block: ``layers.N``) that hold the stage's parameters."""
    parts = [name.split(".") for name, _ in stage.named_parameters()]
    return {".".join(p[:2]) if p[0] == "layers" else p[0] for p in parts}


def run_chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


# ------------------------------------------------------------------ the config
def test_schedule_names_are_torchs():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in PIPELINE_SCHEDULES:
        assert TorchPipelineParallelConfig(schedule=name).schedule_class() is get_schedule_class(name)
    assert TorchPipelineParallelConfig(schedule="gpipe").schedule == "GPipe"  # torch's any case, torch's spelling
    assert TorchPipelineParallelConfig().to_kwargs() == {}
    assert TorchPipelineParallelConfig(schedule="ZBVZeroBubble").style == "v"
    assert TorchPipelineParallelConfig(schedule="Interleaved1F1B").style == "loop"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"schedule": "Zero"}, ValueError, ["schedule", "'Zero'", "'GPipe'", "'DualPipeV'"]),
        ({"schedule": "PipelineScheduleSingle"}, ValueError, ["schedule", "'1F1B'"]),
        ({"schedule": 1}, TypeError, ["schedule", "int"]),
        ({"microbatches": 0}, ValueError, ["microbatches", ">= 1", "0"]),
        ({"microbatches": 2.0}, TypeError, ["microbatches", "integer"]),
        ({"microbatches": True}, TypeError, ["microbatches"]),
        ({"split_points": "layers.4"}, TypeError, ["split_points", "'layers.4'"]),
        ({"split_points": []}, ValueError, ["split_points", "at least one"]),
        ({"split_points": ["layers.4", ""]}, ValueError, ["split_points", "''"]),
        ({"split_points": ["layers.4", "layers.4"]}, ValueError, ["split_points", "more than once"]),
        ({"stages_per_rank": 0}, ValueError, ["stages_per_rank", "0"]),
        ({"stages_per_rank": 2}, ValueError, ["stages_per_rank", "'1F1B'", "one stage"]),
        ({"schedule": "DualPipeV", "stages_per_rank": 3}, ValueError, ["exactly 2", "3"]),
        (
            {"schedule": "Interleaved1F1B", "split_points": ["a.1", "a.2"], "stages_per_rank": 2},
            ValueError,
            ["3 stages", "stages_per_rank=2"],
        ),
    ],
)
def test_config_refusals(kwargs, error, words):
    with pytest.raises(error) as info:
        TorchPipelineParallelConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_config_stages():
    assert TorchPipelineParallelConfig().stages(2) == (2, 1)
    assert TorchPipelineParallelConfig(schedule="Interleaved1F1B").stages(2) == (4, 2)
    assert TorchPipelineParallelConfig(schedule="LoopedBFS", stages_per_rank=3).stages(2) == (6, 3)
    points = TorchPipelineParallelConfig(schedule="Interleaved1F1B", split_points=["l.2", "l.4", "l.6"])
    assert points.stages(2) == (4, 2)
    with pytest.raises(ValueError, match="4 stages.*pp_size=3"):
        points.stages(3)
    with pytest.raises(ValueError, match="exactly 2"):
        TorchPipelineParallelConfig(schedule="ZBVZeroBubble", split_points=["l.1", "l.2", "l.3", "l.4", "l.5"]).stages(
            2
        )
    with pytest.raises(ValueError, match="one stage"):
        TorchPipelineParallelConfig(split_points=["l.2", "l.4", "l.6"]).stages(2)


def test_check_microbatches_agrees_with_torch():
    """Our rule accepts exactly what torch's schedule constructors accept (4 processes, faked in
    this one by torch's fake backend: the constructors only count)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for name in PIPELINE_SCHEDULES:
            config = TorchPipelineParallelConfig(schedule=name)
            num_stages, per_rank = config.stages(4)
            local = stage_indices(config.style, num_stages, 4, 0)
            for m in range(1, 13):
                stages = [PipelineStage(nn.Linear(2, 2), i, num_stages, torch.device("cpu")) for i in local]
                try:
                    config.schedule_class()(stages[0] if per_rank == 1 else stages, m, loss_fn=F.mse_loss)
                    torch_ok = True
                except ValueError:
                    torch_ok = False
                try:
                    ours = check_microbatches(
                        TorchPipelineParallelConfig(schedule=name, microbatches=m), num_stages, 27720
                    )
                    assert ours == m
                except ValueError:
                    ours = None
                assert (ours is not None) == torch_ok, (name, m)
    finally:
        dist.destroy_process_group()


def test_check_microbatches_rules():
    one_f_one_b = TorchPipelineParallelConfig(microbatches=4)
    assert check_microbatches(one_f_one_b, 4, 8) == 4
    with pytest.raises(ValueError, match=r"microbatches=4 does not divide the batch size 10"):
        check_microbatches(one_f_one_b, 4, 10)
    with pytest.raises(ValueError, match=r"microbatches=4 .*at least as many microbatches as stages \(8\)"):
        check_microbatches(one_f_one_b, 8, 8)
    interleaved = TorchPipelineParallelConfig(schedule="Interleaved1F1B", microbatches=9)
    with pytest.raises(ValueError, match=r"rounds.* = 2 with pp_size=4"):
        check_microbatches(interleaved, 8, 18)
    with pytest.raises(ValueError, match="DualPipeV"):
        check_microbatches(TorchPipelineParallelConfig(schedule="DualPipeV", microbatches=3), 4, 12)
    assert check_microbatches(TorchPipelineParallelConfig(schedule="GPipe", microbatches=1), 4, 3) == 1
    # None: the fewest that the schedule accepts, at least one per stage, dividing the batch
    assert check_microbatches(TorchPipelineParallelConfig(), 4, 12) == 4
    assert check_microbatches(TorchPipelineParallelConfig(), 4, 10) == 5
    assert check_microbatches(TorchPipelineParallelConfig(schedule="Interleaved1F1B"), 8, 90) == 10
    with pytest.raises(ValueError, match="a batch of 3 .* at least 4 microbatches"):
        check_microbatches(TorchPipelineParallelConfig(), 4, 3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        check_microbatches(TorchPipelineParallelConfig(), 4, 0)


def test_stage_indices():
    assert [stage_indices("loop", 2, 2, r) for r in range(2)] == [(0,), (1,)]
    assert [stage_indices("loop", 6, 3, r) for r in range(3)] == [(0, 3), (1, 4), (2, 5)]
    assert [stage_indices("v", 8, 4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert set(SINGLE_STAGE_SCHEDULES + V_SCHEDULES) < set(PIPELINE_SCHEDULES)


# ------------------------------------------------------------------ the split
def test_split_names():
    model = TinyLlama()
    plan = split_plan(model, ["layers.3", "layers.6"], 3)
    assert plan.container == "layers"
    assert plan.before == ("tok_embeddings",) and plan.after == ("norm", "output")
    assert [s.blocks for s in plan.stages] == [
        ("layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5"),
        ("layers.6", "layers.7"),
    ]
    assert plan.stages[0].modules[0] == "tok_embeddings" and plan.stages[2].modules[-2:] == ("norm", "output")
    assert [(s.is_first, s.is_last) for s in plan.stages] == [(True, False), (False, False), (False, True)]
    assert plan.split_points == ("layers.3", "layers.6")
    # None: an even split of the largest ModuleList (the first stages get the extra blocks)
    assert [len(s.blocks) for s in split_plan(model, None, 3).stages] == [3, 3, 2]
    assert split_plan(model, None, 2).split_points == ("layers.4",)
    assert split_plan(model, None, 8).split_points == tuple(f"layers.{i}" for i in range(1, 8))
    whole = split_plan(model, None, 1).stages[0]
    assert whole.is_first and whole.is_last and whole.modules[0] == "tok_embeddings" and len(whole.blocks) == LAYERS


def test_nested_container_split():
    model = NestedLM()
    plan = split_plan(model, ["model.layers.2"], 2)
    assert plan.container == "model.layers"
    assert plan.before == ("model.embed_tokens",) and plan.after == ("model.norm", "lm_head")
    stages = [build_stage(model, plan, i) for i in range(2)]
    assert stages[0].model.norm is None and stages[0].lm_head is None and stages[1].model.embed_tokens is None
    keys = [set(stage.state_dict()) for stage in stages]
    assert keys[0] | keys[1] == set(model.state_dict()) and not keys[0] & keys[1]
    assert "model.layers.3.w1.weight" in keys[1] and "lm_head.weight" in keys[1]


@pytest.mark.parametrize("as_dict", [False, True])
def test_each_stage_parameters_and_state_dict(as_dict):
    torch.manual_seed(0)
    model = TinyLlama(as_dict=as_dict)
    whole = model.state_dict()
    plan = split_plan(model, ["layers.3", "layers.6"], 3)
    stages = [build_stage(model, plan, i) for i in range(3)]
    assert [owners(stage) for stage in stages] == [
        {"tok_embeddings", "layers.0", "layers.1", "layers.2"},
        {"layers.3", "layers.4", "layers.5"},
        {"layers.6", "layers.7", "norm", "output"},
    ]
    assert stages[1].tok_embeddings is None and stages[1].norm is None and stages[1].output is None
    seen: dict[str, torch.Tensor] = {}
    for index, stage in enumerate(stages):
        state = stage.state_dict()
        assert tuple(state) == stage_keys(model, plan, index)
        assert "scale" in state  # the model's own buffer is on every stage
        for key, value in state.items():
            assert torch.equal(value, whole[key]), key
            seen[key] = value
    assert set(seen) == set(whole)
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())
    # copy=True left the model whole, and a stage's tensors are its own
    assert len(model.layers) == LAYERS and model.norm is not None
    assert stages[0].tok_embeddings.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize("as_dict", [False, True])
def test_stage_chain_equals_whole_model(as_dict):
    torch.manual_seed(0)
    model = TinyLlama(as_dict=as_dict)
    x = tokens()
    expected = model(x)
    for points in (["layers.4"], ["layers.1", "layers.2", "layers.7"], None):
        num = 3 if points is None else len(points) + 1
        plan = split_plan(model, points, num)
        assert torch.equal(run_chain([build_stage(model, plan, i) for i in range(num)], x), expected)


@pytest.mark.parametrize("as_dict", [False, True])
def test_sequential_stage_runs_a_plain_forward(as_dict):
    torch.manual_seed(0)
    model = PlainModel(as_dict=as_dict)
    x = tokens()
    plan = split_plan(model, None, 3)
    stages = [SequentialStage(build_stage(model, plan, i)) for i in range(3)]
    assert torch.equal(run_chain(stages, x), model(x))
    assert set().union(*(s.state_dict() for s in stages)) == set(model.state_dict())
    assert [name for name, _ in stages[1].named_children()] == ["blocks"]
    with pytest.raises(ValueError, match=r"buffers of its own \('scale'\)"):
        SequentialStage(TinyLlama())


def test_stage_blocks_keep_numbers():
    model = TinyLlama()
    stage = build_stage(model, split_plan(model, ["layers.4"], 2), 1)
    assert isinstance(stage.layers, StageBlocks) and isinstance(stage.layers, nn.ModuleList)
    assert len(stage.layers) == 4 and list(stage.layers._modules) == ["4", "5", "6", "7"]
    assert stage.layers[4] is stage.get_submodule("layers.4")
    assert [b for b in stage.layers] == [stage.layers[i] for i in range(4, 8)]
    with pytest.raises(IndexError, match="block 0 is not on this pipeline stage"):
        stage.layers[0]
    with pytest.raises(TypeError, match="fixed"):
        stage.layers.append(Block())
    stage.layers[5] = nn.Identity()  # as activation checkpointing replaces a block: under its name
    assert isinstance(stage.get_submodule("layers.5"), nn.Identity)
    assert "(4): Block" in repr(stage.layers)


def test_meta_device():
    with torch.device("meta"):
        model = TinyLlama()
    cpu_keys = set(TinyLlama().state_dict())
    plan = split_plan(model, None, 4)
    stages = [build_stage(model, plan, i) for i in range(4)]
    assert all(p.is_meta for s in stages for p in s.parameters())
    assert set().union(*(s.state_dict() for s in stages)) == cpu_keys
    assert [len(s.layers) for s in stages] == [2, 2, 2, 2]
    assert stages[3].norm is not None and stages[3].tok_embeddings is None


def test_copy_skips_what_the_stage_does_not_own(monkeypatch):
    model = TinyLlama()
    copied = []
    deepcopy = nn.Parameter.__deepcopy__

    def counting(self, memo):
        copied.append(self)
        return deepcopy(self, memo)

    monkeypatch.setattr(nn.Parameter, "__deepcopy__", counting)
    stage = build_stage(model, split_plan(model, ["layers.6"], 2), 1)
    assert len(copied) == len(list(stage.parameters())) == 2 * 5 + 2  # two blocks, the norm and the head


def test_copy_false_cuts_the_model_itself():
    model = TinyLlama()
    block5 = model.layers[5]
    plan = split_plan(model, ["layers.4"], 2)
    stage = build_stage(model, plan, 1, copy=False)
    assert stage is model and model.tok_embeddings is None and stage.layers[5] is block5
    with pytest.raises(ValueError, match="does not fit TinyLlama: it has no module 'tok_embeddings'"):
        build_stage(model, plan, 0)  # the model was cut: a refusal, not a wrong stage


# ------------------------------------------------------------------ refusals
def test_split_refusals():
    model = TinyLlama()
    cases = [
        (["layer.3"], 2, "split point 'layer.3' names no module of TinyLlama; did you mean 'layers.3'"),
        (["layers.12"], 2, "'layers.12' names no module"),
        (["norm"], 2, "'norm' names a RMSNorm that is not a block"),
        (["layers.3.attention"], 2, "not a block"),
        (["layers.0"], 2, "first stage would run no block; split at a later block, such as 'layers.1'"),
        (["layers.5", "layers.2"], 3, "not in the blocks' order: give ['layers.2', 'layers.5']"),
        (["layers.4"], 3, "1 split points ['layers.4'] make 2 stages, but there are 3"),
        (None, 9, "each stage needs at least one block; use at most 8 stages"),
        (None, 0, "num_stages must be >= 1, got 0"),
    ]
    for points, num, message in cases:
        with pytest.raises(ValueError) as info:
            split_plan(model, points, num)
        assert message in str(info.value), (points, str(info.value))
    with pytest.raises(TypeError, match="list of block names"):
        split_plan(model, "layers.4", 2)
    plan = split_plan(model, ["layers.4"], 2)
    with pytest.raises(ValueError, match="stage_index must be >= 0 and <= 1, got 2"):
        build_stage(model, plan, 2)
    with pytest.raises(ValueError, match="does not fit PlainModel"):
        build_stage(PlainModel(), plan, 0)


def test_refuses_shared_and_unowned_parameters():
    tied = TinyLlama()
    tied.output.weight = tied.tok_embeddings.weight
    with pytest.raises(ValueError, match=r"'tok_embeddings.weight' \(stage 0\) is the same tensor as output.weight"):
        split_plan(tied, None, 2)
    assert len(split_plan(tied, None, 1).stages) == 1  # on one stage a tied weight is fine
    own = TinyLlama()
    own.bias = nn.Parameter(torch.zeros(DIM))
    with pytest.raises(ValueError, match="parameter 'bias' is in none of the blocks"):
        split_plan(own, None, 2)
    with pytest.raises(ValueError, match="no ModuleList or ModuleDict of blocks"):
        split_plan(nn.Sequential(nn.Linear(2, 2)), None, 1)


def test_config_imports_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; from hasten.settings.pipeline import TorchPipelineParallelConfig as C, check_microbatches; "
        "check_microbatches(C(split_points=['layers.4']), 2, 8); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
