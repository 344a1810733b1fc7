"""Selective activation checkpointing (issue 51): the FSDP plugin's ``activation_checkpointing``
takes "full", "selective" (op-level: matmul, attention and collective outputs kept, the rest
recomputed; or every other matmul), one block in n, and torch.compile's memory budget. One
process, in-process (the FSDP strategy's parallelize pipeline applies it as on several).

What a forward keeps for backward is counted twice: with ``saved_tensors_hooks`` (what autograd
saves outside the checkpointed blocks: a non-reentrant checkpoint packs through hooks of its
own, so an outer hook sees only what crosses the block's border) and as the bytes of every
tensor the forward made that is still alive when it returns (the checkpoints' own caches
included), which is what the modes differ in."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

from hasten import Accelerator, FullyShardedDataParallelPlugin
from hasten.settings.activation_checkpointing import ActivationCheckpointingConfig
from hasten.strategies.parallelize import CheckpointingPlan


class Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))).sin())


class Net(torch.nn.Module):
    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _prepared(mode, **plugin_kwargs) -> tuple[Accelerator, torch.nn.Module]:
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], activation_checkpointing=mode, **plugin_kwargs
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    return acc, acc.prepare(_net())


class _Alive(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes the storage of every tensor an op makes (storages keep their Python object while alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [
            weakref.ref(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)
        ]
        return out

    def alive(self) -> dict[int, int]:
        """The bytes of each storage still alive, by id (aliases counted once)."""
        gc.collect()
        return {id(s): s.nbytes() for ref in self.made if (s := ref()) is not None}


def _kept(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, alive: bool = True
) -> tuple[int, int, list[torch.Tensor]]:
    """(bytes saved through saved_tensors_hooks, bytes of the forward's tensors alive after it
    (not counted with ``alive`` False: a compiled graph runs its own ops), the gradients)."""
    hooked = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        hooked[0] += t.numel() * t.element_size()
        return t

    before = {id(p.untyped_storage()) for p in model.parameters()} | {id(x.untyped_storage())}
    made = _Alive()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), made if alive else contextlib.nullcontext():
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    skip = before | {id(out.untyped_storage()), id(loss.untyped_storage())}
    kept = sum(n for k, n in made.alive().items() if k not in skip)
    model.zero_grad()
    loss.backward()
    return hooked[0], kept, [p.grad.clone() for p in model.parameters()]


def test_selective_keeps_less_than_none_and_more_than_full_with_the_same_gradients():
    x, y = torch.randn(64, 32), torch.randint(0, 5, (64,))
    reference = _net()
    hooked_none, kept_none, grads_none = _kept(reference, x, y)
    results = {}
    for mode in ("full", "selective", ActivationCheckpointingConfig("selective", selective_save="every_other_matmul")):
        _, model = _prepared(mode)
        assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper"] * 4
        hooked, kept, grads = _kept(model, x, y)
        name = mode if isinstance(mode, str) else "every_other_matmul"
        results[name] = kept
        assert hooked < hooked_none  # what crosses the blocks' borders only
        for got, want in zip(grads, grads_none):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # none > selective (every matmul) > every other matmul > full, in bytes kept for backward
    assert kept_none > results["selective"] > results["every_other_matmul"] > results["full"], (kept_none, results)
    # the selective blocks keep their two matmuls' outputs (64 x 128 and 64 x 32 floats) and no more
    per_block = (64 * 128 + 64 * 32) * 4
    assert results["selective"] - results["full"] == 4 * per_block, results
    # every other matmul: the first of each block's two (64 x 128) is kept, the second recomputed
    assert results["every_other_matmul"] - results["full"] == 4 * 64 * 128 * 4, results


def test_one_block_in_n_and_the_offload_compose_with_selective():
    x, y = torch.randn(64, 32), torch.randint(0, 5, (64,))
    _, _, grads_none = _kept(_net(), x, y)
    config = ActivationCheckpointingConfig("selective", every_nth_block=2)
    _, model = _prepared(config, activation_checkpointing_offload=True)
    assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper", "Block"] * 2
    _, _, grads = _kept(model, x, y)
    for got, want in zip(grads, grads_none):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_mode_from_the_plugin_and_the_environment(monkeypatch):
    assert FullyShardedDataParallelPlugin(activation_checkpointing=True).activation_checkpointing_config == (
        ActivationCheckpointingConfig("full")
    )
    plugin = FullyShardedDataParallelPlugin(activation_checkpointing="Selective")
    assert plugin.activation_checkpointing_config.mode == "selective"
    assert FullyShardedDataParallelPlugin().activation_checkpointing_config is None
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "selective")
    assert FullyShardedDataParallelPlugin().activation_checkpointing_config.mode == "selective"
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert FullyShardedDataParallelPlugin().activation_checkpointing_config.mode == "full"
    plan = Accelerator(cpu=True, fsdp_plugin=plugin).strategy.plan.activation_checkpointing
    assert isinstance(plan, CheckpointingPlan) and plan.wrapper is not None and plan.memory_budget is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "some"}, ValueError, r"ActivationCheckpointingConfig.mode must be one of 'full', 'selective'"),
        ({"selective_save": "all"}, ValueError, r"selective_save must be one of 'matmuls', 'every_other_matmul'"),
        ({"every_nth_block": 0}, ValueError, r"every_nth_block must be >= 1"),
        ({"mode": "memory_budget"}, ValueError, r"needs memory_budget"),
        ({"mode": "memory_budget", "memory_budget": 1.5}, ValueError, r"memory_budget must be >= 0 and <= 1"),
        ({"mode": "full", "memory_budget": 0.5}, ValueError, r"is for mode='memory_budget'"),
        ({"mode": "memory_budget", "memory_budget": 0.5, "every_nth_block": 2}, ValueError, r"whole compiled graph"),
    ],
)
def test_a_bad_config_is_refused_where_it_is_written(kwargs, error, match):
    with pytest.raises(error, match=match):
        ActivationCheckpointingConfig(**kwargs)


def test_a_bad_plugin_value_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"activation_checkpointing must be one of 'full', 'selective'"):
        FullyShardedDataParallelPlugin(activation_checkpointing="yes")
    with pytest.raises(TypeError, match=r"must be True or False, one of 'full'.* or an ActivationCheckpointingConfig"):
        FullyShardedDataParallelPlugin(activation_checkpointing=3)
    with pytest.raises(ValueError, match=r"'memory_budget' needs a budget"):
        FullyShardedDataParallelPlugin(activation_checkpointing="memory_budget")
    budget = ActivationCheckpointingConfig("memory_budget", memory_budget=0.5)
    with pytest.raises(ValueError, match=r"activation_checkpointing_offload=True offloads"):
        FullyShardedDataParallelPlugin(activation_checkpointing=budget, activation_checkpointing_offload=True)
    with pytest.raises(ValueError, match=r"applied by torch.compile's partitioner, but nothing is compiled"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=budget))


def test_the_memory_budget_is_compiles_and_keeps_the_gradients():
    import torch._functorch.config as functorch_config

    # torch's own patch puts the process-wide budget back (pytest's monkeypatch would delete the
    # entry from torch's config module: "activation_memory_budget does not exist" in later compiles)
    with functorch_config.patch(activation_memory_budget=functorch_config.activation_memory_budget):
        _check_memory_budget(functorch_config)


def _check_memory_budget(functorch_config) -> None:
    from hasten import TorchDynamoPlugin

    x, y = torch.randn(64, 32), torch.randint(0, 5, (64,))
    _, _, grads_none = _kept(_net(), x, y)
    kept = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        plugin = FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=["Block"],
            activation_checkpointing=ActivationCheckpointingConfig("memory_budget", memory_budget=budget),
        )
        acc = Accelerator(cpu=True, fsdp_plugin=plugin, dynamo_plugin=TorchDynamoPlugin("aot_eager"))
        model = acc.prepare(_net())
        assert not any(type(b).__name__ == "CheckpointWrapper" for b in model.modules())  # no wrapper
        assert functorch_config.activation_memory_budget == budget
        kept[budget], _, grads = _kept(model, x, y, alive=False)  # the compiled graphs save through the hooks
        for got, want in zip(grads, grads_none):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert kept[0.0] < kept[1.0], kept
    torch._dynamo.reset()


def test_a_checkpointed_model_copies_and_keeps_its_names():
    _, model = _prepared("selective")
    assert "blocks.0.up.weight" in model.state_dict()
    copy.deepcopy(model)  # the selective contexts hold no unpicklable state


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_transformers_model_trains_without_its_cache(mode):
    """transformers models fill a key/value cache in a training forward too (``use_cache`` is true
    by default): each block's recomputation would write it again, so selective checkpointing failed
    ("aten.slice.Tensor ... not found in storage") and the cache kept every layer's keys and values.
    Under checkpointing a training forward runs with ``use_cache=False``, as under transformers' own."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=mode
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = acc.prepare(transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert _cache(out) is None
    acc.backward(out.loss)
    reference(input_ids=ids, labels=ids).loss.backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    model.eval()
    with torch.no_grad():  # outside training the cache is the model's own choice
        assert _cache(model(input_ids=ids)) is not None


def _cache(output):
    """The key/value cache a transformers model returned (``cache``; ``past_key_values`` before transformers 5)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")
