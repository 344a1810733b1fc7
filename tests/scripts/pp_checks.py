"""Run by 2 or 4 processes: pipeline-parallel checks (ParallelismConfig.pp_size), one JSON file
per rank (read by tests/test_pipeline.py).

usage: pp_checks.py OUT_DIR two|four

two:  PP 2, every schedule, against one process training the same model on the same batches and
      against a hand-written torch.distributed.pipelining loop; accumulation, clipping,
      evaluation, bad input; a checkpoint saved at PP 2 (1F1B) and loaded at PP 2 (Interleaved).
four: PP 2 x FSDP 2, PP 2 x TP 2, PP 2 x 2 replicas, a model on the meta device outside the main
      process; checkpoints saved at PP 2 x FSDP 2 (loaded at FSDP 4 and at PP 4), at FSDP 4
      (loaded at PP 2 x FSDP 2) and at PP 2 x TP 2 (loaded at PP 2 x FSDP 2).
The checkpoints are left in OUT_DIR for the one-process loads of the test.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from pp_common import LAYERS, TP_PLAN, Llama, dataset, loss_fn  # noqa: E402

from hasten import Accelerator, ParallelismConfig  # noqa: E402
from hasten.settings.pipeline import PIPELINE_SCHEDULES  # noqa: E402
from hasten.utils import FullyShardedDataParallelPlugin, TorchPipelineParallelConfig  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
results: dict = {}
B = 8  # batch size per data-parallel rank
LR = 1e-2


def accelerator(
    schedule="1F1B", pp=2, r=1, s=1, t=1, microbatches=4, accum=1, split_points=None, stages_per_rank=None, **kw
):
    handler = TorchPipelineParallelConfig(
        schedule=schedule, microbatches=microbatches, split_points=split_points, stages_per_rank=stages_per_rank
    )
    pc = ParallelismConfig(
        pp_size=pp,
        dp_replicate_size=r,
        dp_shard_size=s,
        tp_size=t,
        tp_plan=TP_PLAN if t > 1 else None,
        pp_handler=handler,
    )
    if pp == 1:
        pc = ParallelismConfig(dp_replicate_size=r, dp_shard_size=s, tp_size=t, tp_plan=TP_PLAN if t > 1 else None)
    return Accelerator(parallelism_config=pc, gradient_accumulation_steps=accum, **kw)


def full_weights(acc, model):
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b) if a else None


def reference(model, dp, steps, accum, clip):
    """One process: the same model on the global batches (dp ranks' batches side by side)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = iter(torch.utils.data.DataLoader(dataset(), batch_size=B * dp))
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for _ in range(accum):
            x, y = next(loader)
            loss = loss_fn(model(x), y)
            (loss / accum).backward()
            total += float(loss.detach()) / accum
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def train(schedule="1F1B", pp=2, r=1, s=1, t=1, *, steps=3, accum=1, clip=1.0, meta_elsewhere=False, **kw):
    acc = accelerator(schedule, pp, r, s, t, accum=accum, **kw)
    torch.manual_seed(0)
    model = Llama()
    ref = copy.deepcopy(model)
    if meta_elsewhere and not acc.is_main_process:  # only the main process has the weights
        with torch.device("meta"):
            model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, norms, it = [], [], iter(loader)
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            x, y = next(it)
            with acc.accumulate(model):
                loss = acc.pipeline_step(model, x, y, loss_fn)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
            micro.append(float(acc.reduce(loss, "mean")))  # the same on a pipeline's processes: the data ranks' mean
        losses.append(sum(micro) / accum)
    gathered = acc.gather_for_metrics((x, y))
    gathered_objects = acc.gather_for_metrics([int(v) for v in y[:, 0]], use_gather_object=True)
    ref_losses, ref_norms = reference(ref, r * s, steps, accum, clip)
    full = full_weights(acc, model)
    part = acc.unwrap_model(model)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "weight_diff": max_diff(full, ref.state_dict()),
        "keys": list(full),
        "part_keys": sorted(part.state_dict()),
        "part_class": type(part).__name__,
        "stages": list(model.pipeline.stage_ids),
        "optimizer_params": sum(len(g["params"]) for g in opt.optimizer.param_groups),
        "pp_rank": acc.pipeline_parallel_rank,
        "mesh_dims": list(acc.torch_device_mesh.mesh_dim_names),
        "distributed_type": str(acc.distributed_type),
        "param_types": sorted({type(p).__name__ for p in part.parameters()}),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in part.modules()),
        # gather_for_metrics: each data-parallel rank's batch once (the pipeline's processes read the same)
        "gathered_rows": [gathered[0].shape[0], len(gathered_objects)],
        "dp": r * s,
    }


def hand_written(steps=3, microbatches=4):
    """torch.distributed.pipelining by hand, torchtitan's way: PP 2 over every process, 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    stage = Llama()
    half = LAYERS // 2
    if rank == 0:
        del stage.layers[half:]
        stage.norm = stage.output = None
    else:
        del stage.layers[:half]
        stage.tok_embeddings = None
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    schedule = Schedule1F1B(PipelineStage(stage, rank, 2, torch.device("cpu")), microbatches, loss_fn=loss_fn)
    params = [p for p in stage.parameters()]
    loader = iter(torch.utils.data.DataLoader(dataset(), batch_size=B))
    out = []
    for _ in range(steps):
        x, y = next(loader)
        losses: list = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
        dist.all_reduce(norm)  # the norm over both stages, as torchtitan clips
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm.sqrt())
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=1)
        out.append(float(loss))
    return {"losses": out}


def evaluation():
    """pipeline_step under torch.no_grad(): the forward only, the same loss as one process."""
    acc = accelerator("GPipe")
    torch.manual_seed(0)
    model = Llama()
    ref = copy.deepcopy(model)
    model = acc.prepare(model)
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=B)))
    with torch.no_grad():
        loss = acc.pipeline_step(model, x, y, loss_fn)
        ref_loss = loss_fn(ref(x), y)
    grads = [p.grad for p in model.parameters()]
    return {"loss": float(loss), "ref_loss": float(ref_loss), "grads": sum(g is not None for g in grads)}


def refusal(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "not refused"}


def bad_inputs():
    out = {}
    acc = accelerator("1F1B", split_points=["layers.9"])
    torch.manual_seed(0)
    model = Llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out["split_point"] = refusal(lambda: acc.prepare(model))
    out["split_point"]["unchanged"] = model.state_dict().keys() == before.keys() and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items()
    )
    acc = accelerator("Interleaved1F1B", microbatches=8, stages_per_rank=4)  # 8 stages for 4 blocks
    out["too_many_stages"] = refusal(lambda: acc.prepare(Llama()))
    acc = accelerator("1F1B", microbatches=4)
    model = acc.prepare(Llama())
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=6)))
    out["uneven_batch"] = refusal(lambda: acc.pipeline_step(model, x, y, loss_fn))
    out["forward"] = refusal(lambda: model(x))
    out["loss_fn"] = refusal(lambda: acc.pipeline_step(model, x, y, "mse"))
    out["fp16"] = refusal(lambda: accelerator("1F1B", mixed_precision="fp16"))
    return out


def save_then_load(save_shape, load_shapes, name):
    """Train at ``save_shape`` and save; at each of ``load_shapes`` load it into a model with
    other numbers and compare the weights, then one more step on one batch every process reads
    (so every shape takes the same step): its loss and the weights after it (the optimizer's
    state was loaded too) against the saving run's."""
    folder = os.path.join(out_dir, name)
    acc = accelerator(**save_shape, **_plugin(save_shape))
    torch.manual_seed(0)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = [b for _, b in zip(range(2), loader)]
    for x, y in batches:
        acc.pipeline_step(model, x, y, loss_fn)
        opt.step()
        opt.zero_grad()
    acc.save_state(folder)
    saved = full_weights(acc, model)
    acc.save_model(model, folder + "_model")  # the whole model's weights, one file, from the main process
    exported = None
    if acc.is_main_process:
        from safetensors.torch import load_file

        exported = max_diff(load_file(os.path.join(folder + "_model", "model.safetensors")), saved)
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=B)))  # the same on every process
    next_loss = float(acc.pipeline_step(model, x, y, loss_fn))
    opt.step()
    after = full_weights(acc, model)
    if acc.is_main_process:
        torch.save({"saved": saved, "after": after, "next_loss": next_loss, "batch": (x, y)}, folder + ".pt")
    out = {"next_loss": next_loss, "save_model_diff": exported}
    for i, shape in enumerate(load_shapes):
        acc = accelerator(**shape, **_plugin(shape))
        torch.manual_seed(100 + i)
        model = Llama()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=B)
        model, opt, loader = acc.prepare(model, opt, loader)
        acc.load_state(folder)
        loaded = full_weights(acc, model)
        if shape.get("pp", 2) > 1:
            loss = float(acc.pipeline_step(model, x, y, loss_fn))
        else:
            step_loss = loss_fn(model(x), y)
            acc.backward(step_loss)
            loss = float(step_loss)
        opt.step()
        out[f"load{i}"] = {
            "weight_diff": max_diff(loaded, saved),
            "next_loss": loss,
            "after_diff": max_diff(full_weights(acc, model), after),
        }
    return out


def _plugin(shape):
    if shape.get("pp", 2) == 1:  # no pipeline: FSDP's sharded checkpoints ("dcp" layout)
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")}
    return {}


ONLY = set(filter(None, os.environ.get("PP_CHECKS_ONLY", "").split(",")))  # for development: a few checks


def check(name, fn):
    if ONLY and name not in ONLY:
        return
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - recorded, the test shows it
        results[name] = {"error": traceback.format_exc()}


if mode == "two":
    for schedule in PIPELINE_SCHEDULES:  # every schedule hasten offers (test_pipeline.py reads each)
        check(schedule, lambda schedule=schedule: train(schedule))
    check("hand_written", hand_written)
    check("split_points", lambda: train("1F1B", split_points=["layers.1"]))
    check("accumulate", lambda: train("1F1B", accum=2, steps=2, clip=0.05))
    check("compiled", lambda: train("1F1B", dynamo_backend="aot_eager"))  # each block compiled
    check("fp8", lambda: train("1F1B", mixed_precision="fp8"))  # torchao's float8 layers (emulated on the CPU)
    check("evaluation", evaluation)
    check("bad_inputs", bad_inputs)
    check("checkpoint", lambda: save_then_load({"schedule": "1F1B"}, [{"schedule": "Interleaved1F1B"}], "pp2"))
else:
    check("pp2_fsdp2", lambda: train("1F1B", 2, 1, 2, clip=0.05))
    check("pp2_fsdp2_interleaved", lambda: train("Interleaved1F1B", 2, 1, 2))
    check("pp2_tp2", lambda: train("1F1B", 2, 1, 1, 2))
    check("pp2_ddp2", lambda: train("GPipe", 2, 2, 1, 1, clip=0.05))
    check("pp2_fsdp2_meta_elsewhere", lambda: train("1F1B", 2, 1, 2, meta_elsewhere=True))
    check(
        "checkpoint",
        lambda: save_then_load(
            {"schedule": "1F1B", "s": 2}, [{"pp": 1, "s": 4}, {"schedule": "1F1B", "pp": 4}], "pp2_fsdp2"
        ),
    )
    check("checkpoint_back", lambda: save_then_load({"pp": 1, "s": 4}, [{"schedule": "1F1B", "s": 2}], "fsdp4"))
    check(
        "checkpoint_tp", lambda: save_then_load({"schedule": "1F1B", "t": 2}, [{"schedule": "1F1B", "s": 2}], "pp2_tp2")
    )

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
