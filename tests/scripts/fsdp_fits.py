"""Run by 2 processes (phase "first") and then 3 (phase "second"): FSDP2 that fits, one JSON
file of results per rank (read by tests/test_fsdp_fits.py).

usage: fsdp_fits.py OUT_DIR first|second

first:  live memory after prepare and after steps; a model built for real (the reference) that
        saves a DCP checkpoint and safetensors files; the same model built on the meta device on
        every process (initialised, loaded from the checkpoint, from one safetensors file, from a
        sharded index), on the other processes only (cpu_ram_efficient_loading), and models
        nothing fills.
second: memory at 3 processes, the 2-process checkpoint and files loaded at 3.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from fits_common import LM, Raw, lm_batches, lm_loss  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from hasten.training.memory import live_tensor_bytes  # noqa: E402

out_dir, phase = sys.argv[1], sys.argv[2]
results: dict = {}
DATA = lm_batches(9)
CK = os.path.join(out_dir, "ck")


def accelerator(**plugin) -> Accelerator:
    plugin.setdefault("transformer_cls_names_to_wrap", ["Block"])
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin))


def build(meta: bool, cls=LM, **kw):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return cls(**kw)
    return cls(**kw)


def train(acc, model, opt, data):
    r, n = acc.process_index, acc.num_processes
    losses = []
    for tokens in data:
        loss = lm_loss(model, tokens.chunk(n)[r])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def full_weights(acc, model):
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def diff(a, b):
    if not a:
        return None  # not the main process: nothing gathered
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def guarded(name, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - the test reports what failed
        results[name] = {"error": traceback.format_exc()}


def memory():
    """Live tensor bytes above the start, after prepare and after 3 AdamW steps."""
    acc = accelerator()
    data = lm_batches(3, size=6, vocab=512)
    base = live_tensor_bytes()
    model = build(False, vocab=512, dim=256, blocks=4)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    unit = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    after_prepare = live_tensor_bytes() - base
    train(acc, model, opt, data)
    after_steps = live_tensor_bytes() - base
    results["memory"] = {
        "params": params,
        "buffers": buffers,
        "unit": unit,
        "after_prepare": after_prepare,
        "after_steps": after_steps,
        "n": acc.num_processes,
        "replaced_on_meta": all(p.is_meta for p in acc.strategy.swaps.replaced()),
    }


def reference():
    """Built for real: initial weights, 3 steps, a DCP checkpoint and safetensors files, 3 more steps."""
    acc = accelerator()
    model = build(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    initial = full_weights(acc, model)
    first = train(acc, model, opt, DATA[:3])
    acc.save_state(CK)
    saved = full_weights(acc, model)
    acc.save_model(model, os.path.join(out_dir, "st_one"))
    acc.save_model(model, os.path.join(out_dir, "st_index"), max_shard_size="20KB")
    loss_on_saved = lm_loss(acc.unwrap_model(model), DATA[3]).item()
    after = train(acc, model, opt, DATA[3:6])
    results["reference"] = {
        "first": first,
        "after": after,
        "loss_on_saved": loss_on_saved,
        "tied": model.head.weight is model.embed.weight,
    }
    if acc.is_main_process:
        torch.save({"initial": initial, "saved": saved}, os.path.join(out_dir, "reference.pt"))


def ref_weights():
    return torch.load(os.path.join(out_dir, "reference.pt")) if dist.get_rank() == 0 else {"initial": {}, "saved": {}}


def meta_init():
    """Every process on meta, initialised by each module's reset_parameters: the real build's weights."""
    acc = accelerator()
    model = build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    weights = full_weights(acc, model)
    results["meta_init"] = {
        "init_diff": diff(weights, ref_weights()["initial"]) if acc.is_main_process else None,
        "losses": train(acc, model, opt, DATA[:3]),
        "tied": model.head.weight is model.embed.weight,
        "inv_freq": model.rope.inv_freq.tolist(),
    }


def meta_load_state():
    acc = accelerator()
    model = build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.load_state(CK)
    results["meta_load_state"] = {"losses": train(acc, model, opt, DATA[3:6])}


def meta_load_model(where):
    def run():
        acc = accelerator()
        model = build(True)
        model = acc.prepare(model)
        before = rchar()
        acc.load_model(model, where)
        read = rchar() - before
        weights = full_weights(acc, model)
        total = sum(
            os.path.getsize(os.path.join(folder, f))
            for folder in [where if os.path.isdir(where) else os.path.dirname(where)]
            for f in os.listdir(folder)
            if f.endswith(".safetensors")
        )
        results[f"load_model:{os.path.basename(where)}"] = {
            "bytes_read": read,
            "file_bytes": total,
            "n": acc.num_processes,
            "diff": diff(weights, ref_weights()["saved"]) if acc.is_main_process else None,
            "loss": lm_loss(model, DATA[3]).item(),
        }

    return run


def meta_elsewhere():
    """cpu_ram_efficient_loading: the main process builds for real, the others on meta."""
    acc = accelerator(cpu_ram_efficient_loading=True)
    model = build(not acc.is_main_process)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    results["meta_elsewhere"] = {
        "losses": train(acc, model, opt, DATA[:3]),
        "tied": model.head.weight is model.embed.weight,
        "inv_freq": model.rope.inv_freq.tolist(),
    }


def meta_ignored():
    """Every process on meta with the tied head left unsharded (ignored_modules): still tied,
    initialised as the real build, and the optimizer updates the model's own parameters."""
    acc = accelerator(ignored_modules="head")
    model = build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    before = model.embed.weight.detach().clone()
    losses = train(acc, model, opt, DATA[:3])
    results["meta_ignored"] = {
        "first_loss": losses[0],
        "tied": model.head.weight is model.embed.weight,
        "plain": not hasattr(model.embed.weight, "_local_tensor"),
        "optimizer_has_model_params": {id(p) for g in opt.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
        "moved": not torch.equal(before, model.embed.weight.detach()),
    }


def empty_weights():
    """Accelerate's init_empty_weights on every process: parameters on meta, buffers real (kept)."""
    from hasten import init_empty_weights

    acc = accelerator()
    torch.manual_seed(0)
    with init_empty_weights():
        model = LM()
    on_meta = all(p.is_meta for p in model.parameters()) and not model.rope.inv_freq.is_meta
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    results["empty_weights"] = {
        "on_meta": on_meta,
        "losses": train(acc, model, opt, DATA[:3]),
        "inv_freq": model.rope.inv_freq.tolist(),
    }


def unfilled():
    """Tensors nothing initialises: refused at the first forward and at save, named; filled by param_init_fn."""
    acc = accelerator(transformer_cls_names_to_wrap=None)
    model = acc.prepare(build(True, Raw))
    entry = {}
    for what, call in (
        ("forward", lambda: model(torch.ones(2, 8))),
        ("save_model", lambda: acc.save_model(model, os.path.join(out_dir, f"never{acc.process_index}"))),
    ):
        try:
            call()
            entry[what] = None
        except RuntimeError as e:
            entry[what] = str(e)
    entry["never_written"] = not os.path.exists(os.path.join(out_dir, f"never{acc.process_index}"))

    def init(module):
        if isinstance(module, Raw):
            module.gain.fill_(2.0)
            module.shift.fill_(0.25)
        elif isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.1)
            module.bias.zero_()

    acc2 = accelerator(transformer_cls_names_to_wrap=None, param_init_fn=init)
    model2 = acc2.prepare(build(True, Raw))
    torch.manual_seed(0)
    plain = Raw()
    torch.manual_seed(0)
    for m in plain.modules():
        with torch.no_grad():
            init(m)
    x = torch.ones(2, 8)
    entry["init_fn_diff"] = (model2(x) - plain(x)).abs().max().item()
    results["unfilled"] = entry


def gpu_peak(offload):
    """The device's peak during prepare (CUDA only): about 1/N of the model plus one unit; with
    cpu_offload no full tensor reaches the device."""

    def run():
        acc = accelerator(cpu_offload=offload)
        model = build(False, vocab=4096, dim=512, blocks=4)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        unit = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model = acc.prepare(model)
        torch.cuda.synchronize()
        results[f"gpu_peak:{offload}"] = {
            "peak": torch.cuda.max_memory_allocated() - start,
            "params": params,
            "buffers": buffers,
            "unit": unit,
            "n": acc.num_processes,
            "device": str(next(model.parameters()).device),
        }

    return run


if phase == "gpu":
    guarded("gpu_peak:False", gpu_peak(False))
    guarded("gpu_peak:True", gpu_peak(True))
elif phase == "first":
    guarded("memory", memory)
    guarded("reference", reference)
    guarded("meta_init", meta_init)
    guarded("meta_load_state", meta_load_state)
    guarded("load_model:model.safetensors", meta_load_model(os.path.join(out_dir, "st_one", "model.safetensors")))
    guarded("load_model:st_index", meta_load_model(os.path.join(out_dir, "st_index")))
    guarded("meta_elsewhere", meta_elsewhere)
    guarded("empty_weights", empty_weights)
    guarded("meta_ignored", meta_ignored)
    guarded("unfilled", unfilled)
else:
    guarded("memory", memory)
    guarded("meta_load_state", meta_load_state)
    guarded("load_model:st_index", meta_load_model(os.path.join(out_dir, "st_index")))

with open(os.path.join(out_dir, f"{phase}_rank{dist.get_rank()}.json"), "w") as f:
    json.dump(results, f)
