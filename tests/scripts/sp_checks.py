"""Run by 2 or 4 processes: Ulysses sequence parallelism checks (ParallelismConfig(sp_size=...)),
one JSON file per rank (read by tests/test_sequence_parallel.py).

usage: sp_checks.py OUT_DIR

Each training case trains a tiny transformers Llama (sdpa attention) at the given sizes and, on
each process, the same model in plain PyTorch on one process with the same batches (the
reference: per data group, the token-weighted loss of its rows; the step averages the data
groups' gradients, as FSDP does over dp_shard). Labels of -100 are spread unevenly over the
slices so a per-slice mean would differ from the token-weighted one.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from hasten.strategies.sequence_parallel import sequence_parallel_attention, shard_positions, token_weighted_loss

out_dir = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
results: dict = {}
SEQ, ROWS, VOCAB = 16, 2, 64  # tokens per sequence, rows per data group


def llama(heads=4, kv_heads=4, attn="sdpa", hidden=32, **config_attrs):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for name, value in config_attrs.items():  # what the refusals read (sliding windows, layer types)
        setattr(model.config, name, value)
    return model


def batch(g, dp):
    """The global batch: tokens and shift_labels (-100 at the end of each row and uneven elsewhere)."""
    ids = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((dp * ROWS, 1), -100)], dim=1)
    labels[0, : SEQ // 2 + 3] = -100  # the first row's first half (and more) ignored: one slice has few tokens
    labels[-1, torch.randperm(SEQ, generator=g)[:5]] = -100
    return ids, labels


def full_params(acc, model):
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def weight_diff(acc, model, ref):
    """The largest difference to the reference's weights (on the main process, which gathers them)."""
    full = full_params(acc, model)
    return max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()) if full else None


def accelerator(sp, dp=1, tp=1, replicate=1, **plugin):
    pc = ParallelismConfig(sp_size=sp, dp_shard_size=dp, tp_size=tp, dp_replicate_size=replicate, sp_backend="torch")
    plugin.setdefault("transformer_cls_names_to_wrap", ["LlamaDecoderLayer"])
    return Accelerator(parallelism_config=pc, fsdp_plugin=FullyShardedDataParallelPlugin(**plugin))


def train_llama(sp, dp=1, tp=1, steps=3, heads=4, kv_heads=4, dynamo=None, replicate=1, **plugin):
    """``dp`` data groups: dp_shard's, or dp_replicate's where ``replicate`` > 1 (HSDP)."""
    acc = accelerator(sp, 1 if replicate > 1 else dp, tp, replicate, **plugin)
    if dynamo is not None:
        from hasten import TorchDynamoPlugin

        acc = Accelerator(parallelism_config=acc.parallelism_config, fsdp_plugin=acc.strategy.plugin,
                          dynamo_plugin=TorchDynamoPlugin(backend=dynamo))  # fmt: skip
    model, ref = llama(heads, kv_heads), llama(heads, kv_heads)
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    g, d = torch.Generator().manual_seed(2), acc.torch_device_mesh["dp"].get_local_rank()
    losses, ref_losses, outside = [], [], []
    for _ in range(steps):
        ids, labels = batch(g, dp)
        mine_ids, mine_labels = ids[d * ROWS : (d + 1) * ROWS].clone(), labels[d * ROWS : (d + 1) * ROWS].clone()
        buffers = [mine_ids, mine_labels]
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1], no_restore_buffers=set(buffers)):
            assert mine_ids.shape[1] == SEQ // sp
            loss = model(input_ids=mine_ids, shift_labels=mine_labels).loss
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rows = [slice(k * ROWS, (k + 1) * ROWS) for k in range(dp)]
        group_losses = [ref(input_ids=ids[r], shift_labels=labels[r], labels=labels[r]).loss for r in rows]
        torch.stack(group_losses).mean().backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(group_losses[d].item())
    with torch.no_grad():  # outside maybe_context_parallel: the whole sequences on every process, no exchange
        outside.append(model(input_ids=ids[:ROWS], shift_labels=labels[:ROWS], labels=labels[:ROWS]).loss.item())
        outside.append(ref(input_ids=ids[:ROWS], shift_labels=labels[:ROWS], labels=labels[:ROWS]).loss.item())
    diff = weight_diff(acc, model, ref)
    mesh = acc.torch_device_mesh
    return {"losses": losses, "ref_losses": ref_losses, "weight_diff": diff, "outside": outside,
            "mesh": list(mesh.mesh_dim_names), "sp_rank": mesh["sp"].get_local_rank(),
            "fsdp_mesh": sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})}  # fmt: skip


class PlainAttention(nn.Module):
    """A user's own attention: sdpa through hasten's wrapper, learned absolute positions."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.attend = sequence_parallel_attention(nn.functional.scaled_dot_product_attention)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(self.attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))


class PlainLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, 32), nn.Embedding(SEQ, 32)
        self.blocks = nn.ModuleList([PlainAttention(), PlainAttention()])
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(shard_positions(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def plain_loss(model, ids, labels):
    logits = model(ids)
    total = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    return token_weighted_loss(total, (labels != -100).sum())


def train_plain(sp, dp=1, steps=3):
    acc = accelerator(sp, dp, transformer_cls_names_to_wrap=["PlainAttention"])
    torch.manual_seed(0)
    model = PlainLM()
    torch.manual_seed(0)
    ref = PlainLM()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    g, d = torch.Generator().manual_seed(3), acc.torch_device_mesh["dp"].get_local_rank()
    losses, ref_losses = [], []
    for _ in range(steps):
        ids, labels = batch(g, dp)
        mine_ids, mine_labels = ids[d * ROWS : (d + 1) * ROWS].clone(), labels[d * ROWS : (d + 1) * ROWS].clone()
        with acc.maybe_context_parallel(buffers=[mine_ids, mine_labels], buffer_seq_dims=[1, 1]):
            loss = plain_loss(model, mine_ids, mine_labels)
            acc.backward(loss)
        assert mine_ids.shape[1] == SEQ  # restored on exit
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        group = [plain_loss(ref, ids[k * ROWS : (k + 1) * ROWS], labels[k * ROWS : (k + 1) * ROWS]) for k in range(dp)]
        torch.stack(group).mean().backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(group[d].item())
    diff = weight_diff(acc, model, ref)
    return {"losses": losses, "ref_losses": ref_losses, "weight_diff": diff}


class PipeLM(PlainLM):
    """PlainLM whose forward skips the parts a pipeline stage lacks (torchtitan's contract)."""

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos(shard_positions(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def token_loss(logits, labels):
    total = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    return token_weighted_loss(total, (labels != -100).sum())


def train_pipelined(steps=3, microbatches=2):
    """pp 2 x sp 2: each stage's attention exchanged over its sp group, the loss token-weighted on the
    last stage; the reference is one process on the whole sequences, each microbatch's token-weighted
    loss averaged over the microbatches (what pipeline_step computes without sp)."""
    from hasten.utils import TorchPipelineParallelConfig

    handler = TorchPipelineParallelConfig(schedule="1F1B", microbatches=microbatches)
    pc = ParallelismConfig(pp_size=2, sp_size=2, sp_backend="torch", pp_handler=handler)
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["PlainAttention"])
    acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = PipeLM()
    torch.manual_seed(0)
    ref = PipeLM()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(5)
    losses, ref_losses = [], []
    for _ in range(steps):
        ids, labels = batch(g, 1)
        mine_ids, mine_labels = ids.clone(), labels.clone()
        with acc.maybe_context_parallel(buffers=[mine_ids, mine_labels], buffer_seq_dims=[1, 1]):
            loss = acc.pipeline_step(model, mine_ids, mine_labels, token_loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rows = ROWS // microbatches
        parts = [token_loss(ref(ids[k : k + rows]), labels[k : k + rows]) for k in range(0, ROWS, rows)]
        ref_loss = torch.stack(parts).mean()
        ref_loss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(ref_loss.item())
    diff = weight_diff(acc, model, ref)
    mesh = acc.torch_device_mesh
    return {"losses": losses, "ref_losses": ref_losses, "weight_diff": diff,
            "pp_rank": mesh["pp"].get_local_rank(), "sp_rank": mesh["sp"].get_local_rank()}  # fmt: skip


def train_fp8(steps=4):
    """sp 2 with fp8 (torchao float8, emulated on the CPU) beside fp8 without sp on the same 2
    processes (FSDP 2, each the whole sequences): tensorwise scales are taken over each process's
    slice under sp and over the whole sequences without, so the two differ by fp8 rounding only."""
    import warnings

    warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")
    runs = {}
    for sp in (2, 1):
        pc = ParallelismConfig(sp_size=sp, dp_shard_size=3 - sp, sp_backend="torch")
        plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision="fp8")
        model = llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = acc.prepare(model, opt)
        g, losses = torch.Generator().manual_seed(6), []
        for _ in range(steps):
            ids, labels = batch(g, 1)
            with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1]):
                loss = model(input_ids=ids, shift_labels=labels, labels=labels).loss
                acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        kinds = sorted({type(m).__name__ for m in acc.unwrap_model(model).modules() if "Linear" in type(m).__name__})
        runs[sp] = {"losses": losses, "linear_kinds": kinds}
    return {"losses": runs[2]["losses"], "ref_losses": runs[1]["losses"], "linear_kinds": runs[2]["linear_kinds"]}


def refusal(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "not refused"}


def refused_model(**kw):
    def run():
        acc = accelerator(world)
        model = llama(**kw)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = refusal(lambda: acc.prepare(model))
        out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return out

    return run


def data_and_metrics():
    """Every process of an sp group reads the same samples; gather_for_metrics keeps each once."""
    acc = accelerator(2, world // 2)
    data = torch.utils.data.TensorDataset(torch.arange(16))
    loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    seen, gathered = [], []
    for (i,) in loader:
        seen += i.tolist()
        gathered += acc.gather_for_metrics(i).tolist()
    return {"seen": seen, "gathered": sorted(gathered), "sp_rank": acc.torch_device_mesh["sp"].get_local_rank(),
            "dp_rank": acc.torch_device_mesh["dp"].get_local_rank()}  # fmt: skip


def bad_buffers():
    acc = accelerator(world)
    ids = torch.zeros(2, SEQ + 1, dtype=torch.long)

    def enter():
        with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
            pass

    return refusal(enter)


def labels_alone():
    acc = accelerator(world)
    model = acc.prepare(llama())
    ids = torch.randint(0, VOCAB, (2, SEQ))

    def run():
        with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
            model(input_ids=ids, labels=ids)

    return refusal(run)


def checkpoint_reshapes(folder):
    """An sp 2 x dp_shard 2 checkpoint loads at FSDP 4 without sp (FSDP shards the same dims' weights)."""
    acc = accelerator(2, 2)
    model = llama(kv_heads=2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1]):
        acc.backward(model(input_ids=ids, shift_labels=labels).loss)
    opt.step()
    acc.save_state(folder)
    saved = full_params(acc, model)
    other = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=world),
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"]),
    )
    fresh = llama(kv_heads=2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh, fresh_opt = other.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.01))
    other.load_state(folder)
    loaded = full_params(other, fresh)
    return {"equal": all(torch.equal(saved[k], loaded[k]) for k in saved) if saved else None, "keys": len(loaded)}


def check(name, fn):
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - recorded, the test shows it
        results[name] = {"error": traceback.format_exc()}


if world == 2:
    check("sp2", lambda: train_llama(2))
    check("sp2_gqa_replicated", lambda: train_llama(2, heads=4, kv_heads=1))
    check("sp2_selective_ac", lambda: train_llama(2, activation_checkpointing="selective"))
    check("sp2_compiled", lambda: train_llama(2, steps=2, dynamo="aot_eager"))
    check("sp2_plain_module", lambda: train_plain(2))
    check("sp2_fp8", train_fp8)
    check("refused_eager", refused_model(attn="eager"))
    check("refused_heads", refused_model(heads=3, kv_heads=3, hidden=24))
    check("refused_sliding", refused_model(sliding_window=4, layer_types=["sliding_attention"] * 2))
    check("refused_linear", refused_model(layer_types=["full_attention", "linear_attention"]))
    check("refused_length", bad_buffers)
    check("refused_labels_alone", labels_alone)
else:
    check("sp2_dp2", lambda: train_llama(2, 2))
    check("sp2_dp2_gqa", lambda: train_llama(2, 2, heads=4, kv_heads=2))
    check("sp2_tp2", lambda: train_llama(2, 1, 2, heads=4, kv_heads=2))
    check("sp2_hsdp2", lambda: train_llama(2, 2, replicate=2))
    check("sp2_dp2_plain_module", lambda: train_plain(2, 2))
    check("pp2_sp2_plain_module", train_pipelined)
    check("data_and_metrics", data_and_metrics)
    check("checkpoint_at_fsdp4", lambda: checkpoint_reshapes(os.path.join(out_dir, "ck")))

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
