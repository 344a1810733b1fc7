"""Run by 4 processes: N-D parallelism checks (ParallelismConfig), one JSON file per rank
(read by tests/test_parallelism.py).

usage: nd_checks.py OUT_DIR   (launched with --use_parallelism_config --parallelism_config_dp_replicate_size 2
                               --parallelism_config_dp_shard_size 2: the first check reads those)

Each training case trains on the 4 processes and, on each process, runs plain PyTorch on the
global batches (the one-process reference). Checkpoint cases save at one mesh shape and load at
others in the same launch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from nd_common import N, Net, dataset  # noqa: E402,F401

from hasten import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, ParallelismConfig  # noqa: E402

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
results: dict = {}
PLAN = {"blocks.*.a": "colwise", "blocks.*.b": "rowwise"}
B = 2  # batch size per data-parallel rank


def config(r, s, t, plan=PLAN):
    return ParallelismConfig(
        dp_replicate_size=r, dp_shard_size=s, tp_size=t, cp_size=1, tp_plan=plan if t > 1 else None
    )


def plugin(**kw):
    kw.setdefault("auto_wrap_policy", "transformer_based_wrap")
    kw.setdefault("transformer_cls_names_to_wrap", ["Block"])
    kw.setdefault("state_dict_type", "SHARDED_STATE_DICT")
    return FullyShardedDataParallelPlugin(**kw)


def full_params(acc, model):
    sd = acc.get_state_dict(model)
    return {k: v.detach().float().clone() for k, v in sd.items()}


def train(
    r,
    s,
    t,
    *,
    steps=4,
    accum=1,
    clip=0.5,
    fsdp=True,
    mixed_precision=None,
    adopt=False,
    meta_elsewhere=False,
    dynamo_backend=None,
    **kw,
):
    acc = Accelerator(
        parallelism_config=config(r, s, t),
        fsdp_plugin=plugin(**kw) if fsdp else None,
        gradient_accumulation_steps=accum,
        mixed_precision=mixed_precision,
        dynamo_backend=dynamo_backend,
    )
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    if meta_elsewhere and not acc.is_main_process:  # cpu_ram_efficient_loading: only the main process has weights
        with torch.device("meta"):
            model = Net()
    if adopt:  # the user parallelised it on the Accelerator's tp mesh: adopted, not re-wrapped
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for blk in model.blocks:
            parallelize_module(blk, acc.torch_device_mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ds = dataset()
    loader = torch.utils.data.DataLoader(ds, batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    dp = r * s
    ref_loader = iter(torch.utils.data.DataLoader(ds, batch_size=B * dp))
    losses, ref_losses, norms, ref_norms, first = [], [], [], [], None
    it = iter(loader)
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            x, y, i = next(it)
            first = i.tolist() if first is None else first
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
            micro.append(float(acc.reduce(loss.detach(), "mean")))  # equal batches: the mean of the data ranks' means
        losses.append(sum(micro) / accum)
        rl = 0.0
        for _ in range(accum):
            rx, ry, _ = next(ref_loader)
            rloss = nn.functional.mse_loss(ref(rx), ry)
            (rloss / accum).backward()
            rl += float(rloss) / accum
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(rl)
    full = full_params(acc, model)
    diff = max((float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()), default=None) if full else None
    mesh = acc.torch_device_mesh
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "weight_diff": diff,
        "keys": sorted(full),
        "first_batch": first,
        "distributed_type": str(acc.distributed_type),
        "ranks": {
            "dp_replicate": acc.data_parallel_rank,
            "dp_shard": acc.data_parallel_shard_rank,
            "tp": acc.tensor_parallel_rank,
            "cp": acc.context_parallel_rank,
            "dp": mesh["dp"].get_local_rank(),
        },
        "mesh_dims": list(mesh.mesh_dim_names),
        "mesh_shape": list(mesh.shape),
        "flattened": {n: mesh[n].size() for n in ("dp", "dp_shard_cp", "dp_cp")},
        "param_meshes": sorted(
            {str(getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names) for p in model.parameters()}
        ),
        "loader_len": len(loader),
    }


ONLY = set(filter(None, os.environ.get("ND_CHECKS_ONLY", "").split(",")))  # for development: a few checks


def check(name, fn):
    if ONLY and name not in ONLY:
        return
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - recorded, the test shows it
        results[name] = {"error": traceback.format_exc()}


def from_launcher():
    acc = Accelerator()
    pc = acc.parallelism_config
    return {
        "sizes": [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size],
        "env": os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG"),
        "distributed_type": str(acc.distributed_type),
        "mesh_dims": list(acc.torch_device_mesh.mesh_dim_names),
    }


def refusal(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "not refused"}


def bad_plan(plan):
    def run():
        acc = Accelerator(parallelism_config=config(1, 2, 2, plan=plan), fsdp_plugin=plugin())
        torch.manual_seed(0)
        model = Net()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = refusal(lambda: acc.prepare(model))
        out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return out

    return run


def llama_tp(steps=3):
    """A transformers model with its own plan (model._tp_plan: embedding, attention, MLP, lm_head)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {"skipped": "transformers is not installed"}
    acc = Accelerator(
        parallelism_config=config(1, 2, 2, plan=None),
        fsdp_plugin=plugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"]),
    )
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(2)
    losses, ref_losses = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 12), generator=g)  # the global batch: 2 rows per data rank
        mine = tokens.view(2, 2, 12)[acc.torch_device_mesh["dp"].get_local_rank()]
        loss = model(input_ids=mine, labels=mine).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), "mean")))
        rloss = torch.stack([ref(input_ids=t, labels=t).loss for t in tokens.view(2, 2, 12)]).mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(float(rloss))
    full = full_params(acc, model)
    diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items() if k in full) if full else None
    meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight_diff": diff,
        "param_meshes": meshes,
        "keys_match": sorted(full) == sorted(ref.state_dict()) if full else None,
    }


def model_files(folder):
    """save_model at TP 2 x FSDP 2, load_model into a model with other weights at the same mesh:
    each process reads its slices of the safetensors file."""
    acc = Accelerator(parallelism_config=config(1, 2, 2), fsdp_plugin=plugin())
    torch.manual_seed(0)
    model = acc.prepare(Net())
    saved = full_params(acc, model)
    acc.save_model(model, folder)
    torch.manual_seed(9)
    other = acc.prepare(Net())
    acc.load_model(other, folder)
    loaded = full_params(acc, other)
    return {"diff": max(float((loaded[k] - v).abs().max()) for k, v in saved.items()) if saved else None}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(40))


def iterable_tp():
    """An iterable dataset at TP 2 x FSDP 2: each data group reads its share, its TP ranks the same."""
    acc = Accelerator(parallelism_config=config(1, 2, 2))
    loader = acc.prepare(torch.utils.data.DataLoader(Stream(), batch_size=2))
    refused = refusal(
        lambda: Accelerator(
            parallelism_config=config(1, 2, 2), dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
        ).prepare(torch.utils.data.DataLoader(Stream(), batch_size=2))
    )
    return {
        "batches": [b.tolist() for b in loader],
        "dp": acc.torch_device_mesh["dp"].get_local_rank(),
        "refused": refused,
    }


# ---------------------------------------------------------------------- checkpoints
def ck_train(r, s, t, folder, steps, **kw):
    acc = Accelerator(parallelism_config=config(r, s, t), fsdp_plugin=plugin(**kw))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    it = iter(loader)
    for _ in range(steps):
        x, y, _ = next(it)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    acc.save_state(folder)
    at_save = full_params(acc, model)
    if acc.is_main_process:
        torch.save(at_save, folder + ".weights.pt")  # for the one-process load and merge-weights in the test
    saved = {k: v.sum().item() for k, v in at_save.items()}
    x, y, i = next(it)
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()  # one more step after the save: what a resume must reproduce
    return {
        "saved": saved,
        "params": {k: v.sum().item() for k, v in full_params(acc, model).items()},
        "next": sorted(set(acc.gather(i).tolist())),
        "consumed": steps * B * r * s,
    }


def ck_load(r, s, t, folder, fsdp=True, **kw):
    acc = Accelerator(parallelism_config=config(r, s, t), fsdp_plugin=plugin(**kw) if fsdp else None)
    torch.manual_seed(123)  # other weights than the saving run: the load must replace them
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(folder)
    loaded = {k: v.sum().item() for k, v in full_params(acc, model).items()}
    x, y, i = next(iter(loader))
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    return {
        "loaded": loaded,
        "after_step": {k: v.sum().item() for k, v in full_params(acc, model).items()},
        "next": sorted(set(acc.gather(i).tolist())),
        "dp": r * s,
    }


check("from_launcher", from_launcher)
check("hsdp_2x2", lambda: train(2, 2, 1))
check("tp2_fsdp2", lambda: train(1, 2, 2))
check("tp4", lambda: train(1, 1, 4))
check("ddp_4", lambda: train(4, 1, 1, fsdp=False))
check("fsdp_4", lambda: train(1, 4, 1))
check("hsdp_accum_ac", lambda: train(2, 2, 1, steps=3, accum=2, activation_checkpointing=True))
check("tp2_fsdp2_accum_ac", lambda: train(1, 2, 2, steps=3, accum=2, activation_checkpointing=True))
check("tp2_fsdp2_adopted", lambda: train(1, 2, 2, adopt=True))
check("replicate2_tp2", lambda: train(2, 1, 2))
check("tp2_fsdp2_meta_elsewhere", lambda: train(1, 2, 2, meta_elsewhere=True, cpu_ram_efficient_loading=True))
check("tp2_fsdp2_compiled", lambda: train(1, 2, 2, steps=3, dynamo_backend="aot_eager"))
check("tp2_fsdp2_bf16", lambda: train(1, 2, 2, mixed_precision="bf16"))
check("llama_own_plan", llama_tp)
check("iterable_tp2_fsdp2", iterable_tp)
check("model_files_tp2_fsdp2", lambda: model_files(os.path.join(out_dir, "model_files")))
check("no_plan", bad_plan(None))
check("plan_names_nothing", bad_plan({"layers.*.q": "colwise"}))
ck = os.path.join(out_dir, "ck")
check("ck_save_hsdp", lambda: ck_train(2, 2, 1, os.path.join(ck, "hsdp"), 3))
check("ck_hsdp_at_fsdp4", lambda: ck_load(1, 4, 1, os.path.join(ck, "hsdp")))
check("ck_hsdp_at_replicate4", lambda: ck_load(4, 1, 1, os.path.join(ck, "hsdp")))
check("ck_hsdp_at_tp2_fsdp2", lambda: ck_load(1, 2, 2, os.path.join(ck, "hsdp")))
check("ck_save_tp2_fsdp2", lambda: ck_train(1, 2, 2, os.path.join(ck, "tp"), 2))
check("ck_tp_at_fsdp4", lambda: ck_load(1, 4, 1, os.path.join(ck, "tp")))
check("ck_tp_at_tp4", lambda: ck_load(1, 1, 4, os.path.join(ck, "tp")))
FULL = {"state_dict_type": "FULL_STATE_DICT"}
check("ck_save_tp2_fsdp2_full", lambda: ck_train(1, 2, 2, os.path.join(ck, "tp_full"), 2, **FULL))
check("ck_tp_full_at_hsdp", lambda: ck_load(2, 2, 1, os.path.join(ck, "tp_full"), **FULL))

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
