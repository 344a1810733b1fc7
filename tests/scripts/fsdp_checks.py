"""Run by 2 processes: FSDP2 checks, one JSON file of results per rank (read by tests/test_fsdp.py).

usage: fsdp_checks.py OUT_DIR

Each training case runs FSDP2 on the 2 processes (each with half of every batch) and, on each
process, plain PyTorch on the full batches (the one-process reference), and records both.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import batches, make_model, reference_train  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

out_dir = sys.argv[1]
results: dict = {}
DATA = batches(8)


def fsdp_train(data, *, accum=1, clip=None, mixed_precision=None, lr=0.05, meta_elsewhere=False, **plugin):
    plugin.setdefault("transformer_cls_names_to_wrap", ["Block"])
    acc = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(**plugin),
        gradient_accumulation_steps=accum,
        mixed_precision=mixed_precision,
    )
    if meta_elsewhere and not acc.is_main_process:
        with torch.device("meta"):  # only the main process has real weights
            model = make_model()
    else:
        model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model, opt = acc.prepare(model, opt)
    r, n = acc.process_index, acc.num_processes
    losses, norms, step_loss = [], [], 0.0
    for x, y in data:
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
            acc.backward(loss)
            step_loss += acc.reduce(loss.detach(), "mean").item() / accum
            if acc.sync_gradients:
                if clip is not None:
                    norms.append(acc.clip_grad_norm_(model.parameters(), clip).item())
                opt.step()
                opt.zero_grad()
                losses.append(step_loss)
                step_loss = 0.0
    return acc, model, opt, losses, norms


def compare(case, **kwargs):
    accum, clip = kwargs.get("accum", 1), kwargs.get("clip")
    acc, model, _, losses, norms = fsdp_train(DATA, **kwargs)
    full = acc.get_state_dict(model)  # gathered to the main process, empty elsewhere
    ref_losses, ref_norms, ref_weights = reference_train(DATA, accum=accum, clip=clip)
    entry = {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "keys": sorted(full),
        "ref_keys": sorted(ref_weights),
    }
    if acc.is_main_process:
        entry["weight_diff"] = max((full[k].float() - ref_weights[k]).abs().max().item() for k in ref_weights)
    results[case] = entry
    return acc, model


def guarded(name, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - the test reports what failed
        results[name] = {"error": traceback.format_exc()}


# ---- parity with one process on the full batches, and what the wrapping looks like
def plain():
    acc, model = compare("plain")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    block = model.blocks[0]
    results["facts"] = {
        "distributed_type": str(acc.distributed_type),
        "strategy": type(acc.strategy).__name__,
        "layout": acc.strategy.checkpoint_layout,
        "root_is_fsdp": isinstance(model, FSDPModule),
        "blocks_are_fsdp": [isinstance(b, FSDPModule) for b in model.blocks],
        "unwrap_is_model": acc.unwrap_model(model) is model,
        "optimizer_params_dtensor": all(isinstance(p, DTensor) for p in acc._optimizers[0].param_groups[0]["params"]),
        "optimizer_params_are_model_params": {id(p) for p in acc._optimizers[0].param_groups[0]["params"]}
        == {id(p) for p in model.parameters()},
        "hyperparameters": {k: v for k, v in acc._optimizers[0].param_groups[0].items() if k in ("lr", "weight_decay")},
        # elements each process holds of every parameter of a wrapped block vs the full count
        "block_local": {n: p.to_local().numel() for n, p in block.named_parameters()},
        "block_global": {n: p.numel() for n, p in block.named_parameters()},
        "mesh": [acc.strategy.mesh.device_type, list(acc.strategy.mesh.shape)],
    }
    results["facts"]["save_model"] = [
        os.path.basename(f) for f in acc.save_model(model, os.path.join(out_dir, "saved_model"))
    ]


guarded("plain", plain)
guarded("accum4", lambda: compare("accum4", accum=4))
guarded("clip", lambda: compare("clip", clip=0.5))
guarded("cpu_offload", lambda: compare("cpu_offload", cpu_offload=True))
guarded("no_reshard", lambda: compare("no_reshard", reshard_after_forward=False))


def activation_checkpointing():
    _, model = compare("activation_checkpointing", activation_checkpointing=True)
    results["activation_checkpointing"]["block_children"] = [type(c).__name__ for c in model.blocks.children()]


guarded("activation_checkpointing", activation_checkpointing)
guarded(
    "activation_checkpointing_offload",  # the block inputs wait for backward under save_on_cpu
    lambda: compare(
        "activation_checkpointing_offload", activation_checkpointing=True, activation_checkpointing_offload=True
    ),
)
guarded("meta_elsewhere", lambda: compare("meta_elsewhere", cpu_ram_efficient_loading=True, meta_elsewhere=True))


def ignored():
    acc, model, _, losses, _ = fsdp_train(DATA[:2], ignored_modules=r"^head$")
    from torch.distributed.tensor import DTensor

    results["ignored"] = {
        "head_plain": [not isinstance(p, DTensor) for p in model.head.parameters()],
        "blocks_dtensor": all(isinstance(p, DTensor) for p in model.blocks.parameters()),
        "losses": losses,
    }


guarded("ignored", ignored)
guarded(
    "size_based",
    lambda: compare(
        "size_based", auto_wrap_policy="size_based_wrap", min_num_params=500, transformer_cls_names_to_wrap=None
    ),
)


# ---- bf16: FSDP's MixedPrecisionPolicy, not the autocast forward
def bf16():
    seen = []
    data = [DATA[0]] * 8  # one batch over and over: the loss must fall
    acc = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]), mixed_precision="bf16"
    )
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, opt = acc.prepare(model, opt)
    model.blocks[0].up.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    r, n = acc.process_index, acc.num_processes
    losses = []
    for x, y in data:
        out = model(x.chunk(n)[r])
        loss = nn.functional.cross_entropy(out, y.chunk(n)[r])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    results["bf16"] = {
        "losses": losses,
        "inner_output_dtype": seen[0],
        "model_output_dtype": str(out.dtype),
        "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "autocast_forward": hasattr(model.forward, "_hasten_original_forward"),
    }


guarded("bf16", bf16)


# ---- fp16: the skip decision agrees on every process (ShardedGradScaler)
def fp16():
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), mixed_precision="fp16")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x, y = DATA[0]
    r, n = acc.process_index, acc.num_processes
    skipped = []
    for poison in (False, True):
        acc.backward(nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]))
        if poison and r == 0:  # an inf in one shard of one process only
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        norm = acc.clip_grad_norm_(model.parameters(), 1.0)  # unscales (ShardedGradScaler) first
        before = [p.detach().to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
        skipped.append([acc.optimizer_step_was_skipped, changed, bool(torch.isfinite(norm))])
    results["fp16"] = {"scaler": type(acc.scaler).__name__, "skipped_changed": skipped}


guarded("fp16", fp16)


# ---- checkpoints: save at 2 processes, load at 2, continue
def checkpoints():
    ck = os.path.join(out_dir, "ckpt")
    data = DATA[:6]

    def run(load: str | None, state_dict_type="SHARDED_STATE_DICT"):
        # step_scheduler_with_optimizer=False: the LR schedule follows scheduler.step() calls, the same
        # at any number of processes (Accelerate's default steps it num_processes times per step)
        acc = Accelerator(
            fsdp_plugin=FullyShardedDataParallelPlugin(
                transformer_cls_names_to_wrap=["Block"], state_dict_type=state_dict_type
            ),
            step_scheduler_with_optimizer=False,
        )
        model = make_model(seed=0 if load is None else 5)  # other weights: the checkpoint must replace them
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        model, opt, sched = acc.prepare(model, opt, sched)
        r, n = acc.process_index, acc.num_processes
        losses, saved = [], None

        def step(x, y):
            loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())

        if load is None:
            for b in data[:3]:
                step(*b)
            acc.save_state(os.path.join(ck, state_dict_type))
            saved = acc.get_state_dict(model)
        else:
            acc.load_state(load)
            saved = acc.get_state_dict(model)
        for b in data[3:]:
            step(*b)
        final = acc.get_state_dict(model)
        return losses, saved, final

    out = {}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        losses, at_save, final = run(None, kind)
        losses2, at_load, final2 = run(os.path.join(ck, kind), kind)
        with open(os.path.join(ck, kind, "hasten_checkpoint.json")) as f:
            layout = json.load(f)["layout"]
        entry = {"losses": losses, "resumed_losses": losses2, "layout": layout}
        if dist.get_rank() == 0:
            entry["load_diff"] = max((at_save[k] - at_load[k]).abs().max().item() for k in at_save)
            entry["final_diff"] = max((final[k] - final2[k]).abs().max().item() for k in final)
            if kind == "SHARDED_STATE_DICT":
                torch.save({k: t.clone() for k, t in at_save.items()}, os.path.join(out_dir, "weights_at_save.pt"))
                torch.save({k: t.clone() for k, t in final.items()}, os.path.join(out_dir, "weights_final.pt"))
        out[kind] = entry
    results["checkpoints"] = out


guarded("checkpoints", checkpoints)


# ---- bad input, each where it enters
def bad_input():
    errors = {}
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]))
    ddp = nn.parallel.DistributedDataParallel(make_model())
    for name, fn in {
        "ddp_model": lambda: acc.prepare(ddp),
        "unknown_class": lambda: Accelerator(
            fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["DecoderLayer"])
        ).prepare(make_model()),
        "optimizer_first": lambda: acc.prepare(torch.optim.SGD(make_model().parameters(), lr=0.1)),
    }.items():
        try:
            fn()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            errors[name] = f"{type(e).__name__}: {e}"
    results["bad_input"] = errors


guarded("bad_input", bad_input)

with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(results, f)
