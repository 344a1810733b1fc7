"""Run by 2 processes: expert parallelism checks (ParallelismConfig(dp_shard_size=2, ep_size=2)),
one JSON file per rank (read by tests/test_expert_parallel.py).

usage: ep_checks.py OUT_DIR   (2 processes: dp_shard 2 x ep 2; 4: dp_shard 4 with ep 2 and ep 4,
                              dp_replicate 2 x dp_shard 2 x ep 2, tp 2 x dp_shard 2 x ep 2,
                              pp 2 x dp_shard 2 x ep 2)

Each training case trains a tiny MoE (transformers' Qwen3-MoE and Mixtral with their router aux
loss, and a model of the user's own whose experts are declared by class name) and, on each
process, the same model in plain PyTorch on one process: each step the mean of the data ranks'
losses on their slices of the global batch (what FSDP over dp_shard averages). The checkpoint
cases save at ep 2 and load at FSDP 2 without ep, and back.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from hasten.settings.expert_parallel import TorchExpertParallelConfig

out_dir = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
results: dict = {}
SEQ, ROWS, VOCAB = 8, 2, 64
CLIP = 1.0  # below the gradients' norm: every step clips


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                         initializer_range=0.2, max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation, cfg.use_cache = "eager", False  # no KV cache: recomputed blocks would extend it
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg), "Qwen3MoeDecoderLayer"


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.1, initializer_range=0.2,
                        max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation, cfg.use_cache = "eager", False  # no KV cache: recomputed blocks would extend it
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg), "MixtralDecoderLayer"


class MyExperts(nn.Module):
    """A user's own experts, in transformers' layout."""

    def __init__(self, experts=4, width=16, inner=8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, width) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, width, inner) * 0.3)
        self.act_fn = nn.SiLU()

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class MyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(16, 4, bias=False), MyExperts()

    def forward(self, h):
        flat = h.reshape(-1, h.shape[-1])
        weights, index = self.router(flat).softmax(-1).topk(2, dim=-1)
        return h + self.experts(flat, index, weights).view_as(h)


class MyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.blocks, self.head = nn.Embedding(VOCAB, 16), nn.ModuleList([MyBlock(), MyBlock()]), None
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class PipeMoE(nn.Module):
    """MyMoE's blocks in torchtitan's pipeline contract: the forward skips the parts a stage lacks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers = nn.Embedding(VOCAB, 16), nn.ModuleList([MyBlock() for _ in range(4)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.embed(ids) if self.embed is not None else ids
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if self.head is not None else h


def token_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_pipeline(steps=3):
    """pp 2 x dp_shard 2 x ep 2 (1F1B, 2 microbatches): each stage's experts split over its ep group."""
    from hasten.utils import TorchPipelineParallelConfig

    pc = ParallelismConfig(pp_size=2, dp_shard_size=2, ep_size=2, ep_handler=TorchExpertParallelConfig(["MyExperts"]),
                           pp_handler=TorchPipelineParallelConfig(schedule="1F1B", microbatches=2))  # fmt: skip
    acc = Accelerator(parallelism_config=pc)
    model, ref = PipeMoE(), PipeMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    dp_mesh = acc.torch_device_mesh["dp"]
    g, d, dp = torch.Generator().manual_seed(2), dp_mesh.get_local_rank(), dp_mesh.size()
    losses, ref_losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
        mine = ids[d * ROWS : (d + 1) * ROWS]
        loss = acc.pipeline_step(model, mine, torch.roll(mine, -1, dims=1), token_loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss, "mean")))  # the data ranks' mean
        ref_loss = token_loss(ref(ids), torch.roll(ids, -1, dims=1))
        ref_loss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = full_params(acc, model)
    diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()) if full else None
    return {"losses": losses, "ref_losses": ref_losses, "weight_diff": diff, "norms": [], "ref_norms": [],
            "keys_match": sorted(full) == sorted(ref.state_dict()) if full else None,
            "placement": expert_placement(acc.unwrap_model(model)), "pp_rank": acc.pipeline_parallel_rank}  # fmt: skip


def loss_of(model, ids, labels):
    if isinstance(model, MyMoE):
        return model(ids, labels)
    return model(input_ids=ids, labels=labels).loss  # includes router_aux_loss_coef x the router's aux loss


#: tensor parallelism on the attention only (not on the experts)
ATTENTION_TP = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}  # fmt: skip


def accelerator(ep, wrap, experts=None, sharded_state=False, dynamo=None, replicate=1, tp=1, precision=None, **plugin):
    pc = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=world // replicate // tp, tp_size=tp, ep_size=ep,
                           tp_plan=ATTENTION_TP if tp > 1 else None,
                           ep_handler=TorchExpertParallelConfig(experts=experts) if experts else None)  # fmt: skip
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=[wrap], state_dict_type="SHARDED_STATE_DICT" if sharded_state else None, **plugin
    )
    if dynamo is not None:
        from hasten import TorchDynamoPlugin

        return Accelerator(parallelism_config=pc, fsdp_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(backend=dynamo))
    return Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision=precision)


def full_params(acc, model):
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def expert_kernels(model):
    """How each experts module ran its experts: the (device, dtype) pairs it ran as grouped_mm, as a loop."""
    runs = {"grouped_mm": set(), "loop": set()}
    for m in model.modules():
        for (device, dtype), grouped in getattr(getattr(m, "_hasten_ep", None), "grouped", {}).items():
            runs["grouped_mm" if grouped else "loop"].add(f"{device}/{str(dtype).removeprefix('torch.')}")
    return {k: sorted(v) for k, v in runs.items()}


def expert_placement(model):
    from torch.distributed.tensor import DTensor

    found = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert isinstance(p, DTensor), name
            found[name] = {"mesh": list(p.device_mesh.mesh_dim_names), "placements": str(p.placements),
                           "shape": list(p.shape), "local": list(p.to_local().shape)}  # fmt: skip
    return found


def train(build, ep=2, steps=3, experts=None, folder=None, **options):
    model, wrap = build()
    ref, _ = build()
    acc = accelerator(ep, wrap, experts, sharded_state=folder is not None, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    dp_mesh = acc.torch_device_mesh["dp"]
    g, d, dp = torch.Generator().manual_seed(2), dp_mesh.get_local_rank(), dp_mesh.size()
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
        mine = slice(d * ROWS, (d + 1) * ROWS)
        loss = loss_of(model, ids[mine], ids[mine])
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))  # the norm over every mesh
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        group = [loss_of(ref, ids[k * ROWS : (k + 1) * ROWS], ids[k * ROWS : (k + 1) * ROWS]) for k in range(dp)]
        torch.stack(group).mean().backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(group[d].item())
    full = full_params(acc, model)
    diffs = {k: float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()} if full else {}
    diff = max(diffs.values()) if full else None
    result = {"losses": losses, "ref_losses": ref_losses, "weight_diff": diff, "norms": norms, "ref_norms": ref_norms,
              "placement": expert_placement(model), "kernels": expert_kernels(model),
              "worst": sorted(diffs, key=diffs.get)[-3:],
              "keys_match": sorted(full) == sorted(ref.state_dict()) if full else None}  # fmt: skip
    if options.get("precision") is not None:
        result["_model"] = acc.unwrap_model(model)
    if folder is not None:
        acc.save_state(folder)
        if acc.is_main_process:
            torch.save(full, folder + ".weights.pt")  # for the one-process load in the test
    return result


def load(build, ep, folder, save_to=None):
    """A fresh model (other weights) at ``ep`` loads ``folder``; returns the largest difference to the saved weights."""
    model, wrap = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc = accelerator(ep, wrap, sharded_state=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    acc.load_state(folder)
    full = full_params(acc, model)
    saved = torch.load(folder + ".weights.pt") if acc.is_main_process else {}
    diff = max(float((full[k] - saved[k]).abs().max()) for k in saved) if saved else None
    if save_to is not None:
        acc.save_state(save_to)
        if acc.is_main_process:
            torch.save(full, save_to + ".weights.pt")
    return {"load_diff": diff, "keys_match": sorted(full) == sorted(saved) if saved else None}


def with_and_without_ep(precision):
    """bf16 (FSDP's MixedPrecisionPolicy: the experts gathered and exchanged in bf16), or fp8
    (emulated on the CPU; it converts the non-expert Linears): ep 2 trains as FSDP 2 without ep."""
    import warnings

    warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")
    ep2 = train(qwen3_moe, steps=2, precision=precision)
    ep1 = train(qwen3_moe, steps=2, ep=1, precision=precision)
    model = ep2.pop("_model")
    kinds = sorted({type(m).__name__ for m in model.modules()} & {"Float8Linear", "Linear"})
    ep1.pop("_model")
    return {"ep2": ep2["losses"], "ep1": ep1["losses"], "linear_kinds": kinds, "kernels": expert_kernels(model)}


def refused_without_experts():
    acc = accelerator(2, "Linear")
    try:
        acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    except ValueError as e:
        return {"error_text": str(e)}
    return {"error_text": None}


def run(name, fn, *args, **kwargs):
    try:
        results[name] = fn(*args, **kwargs)
    except Exception as e:  # recorded for the test, which shows it
        results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}


ck = os.path.join(out_dir, "ck")
run("qwen3_moe", train, qwen3_moe, folder=ck + "_ep2")
if world == 2:
    run("mixtral", train, mixtral)
    run("own_model", train, lambda: (MyMoE(), "MyBlock"), experts=["MyExperts"])
    run("activation_checkpointing", train, qwen3_moe, steps=2, activation_checkpointing=True)
    run("compiled", train, qwen3_moe, steps=2, dynamo="aot_eager")
    run("fp8", with_and_without_ep, "fp8")
    run("bf16", with_and_without_ep, "bf16")
    run("ep2_to_fsdp", load, qwen3_moe, 1, ck + "_ep2", save_to=ck + "_fsdp")
    run("fsdp_to_ep2", load, qwen3_moe, 2, ck + "_fsdp")
    run("no_experts", refused_without_experts)
else:  # dp_shard 4: ep 2 (FSDP over efsdp 2 shards each expert further), ep 4 (one expert each)
    run("ep4", train, qwen3_moe, ep=4)
    run("hsdp", train, qwen3_moe, replicate=2)  # dp_replicate 2 x dp_shard 2 (ep 2): the experts on HSDP
    # tp 2 x dp_shard 2 (ep 2): TP on the attention, not on the experts. Mixtral: Qwen3's q_norm/k_norm
    # (shared over the heads TP splits) need transformers' "replicated_with_grad_allreduce", not in hasten's TP
    run("tp", train, mixtral, tp=2)
    run("pp", train_pipeline)
    run("ep2_to_ep4", load, qwen3_moe, 4, ck + "_ep2")
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
