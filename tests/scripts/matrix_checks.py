"""Every checkpoint shape into every shape (issue 49): run by 1, 2 or 4 processes (or imported by
tests/test_checkpoint_matrix.py for the one-process shapes), one JSON file per rank.

usage: matrix_checks.py OUT_DIR SAVE PAIRS CHECKPOINT_DIR...
    SAVE 1: train and save at each shape of this number of processes, into OUT_DIR/<shape>;
    then load every checkpoint found in OUT_DIR and in each CHECKPOINT_DIR at each shape of this
    number of processes (PAIRS "all"), or only the pairs of ``subset_pairs`` (PAIRS "subset"),
    recording per pair (rank{RANK}.json: {"<saved>-><loaded>": {...}}).

Every shape trains the same tiny Llama (pp_common) on batches every process reads whole, so
each data-parallel rank's gradient is the one-process gradient: a run at any shape is the
one-process run up to the order of its sums. A save: 2 steps, ``save_state``, then 2 more steps
(the uninterrupted run's losses and weights, written with the saved weights to
``<shape>.pt`` by the main process). A load: a model of other numbers at the loading shape,
``load_state``, its weights against the saved ones (exactly), then the same 2 steps: losses and
weights against the uninterrupted run's (the second step's loss needs the optimizer's state).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from pp_common import TP_PLAN, Llama, dataset, loss_fn  # noqa: E402

from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig  # noqa: E402

warnings.filterwarnings("ignore", message="mixed_precision='fp8' on a CPU")
LR = 1e-2
SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"

#: shape name -> (processes, ParallelismConfig arguments or None, FSDP state_dict_type or None, fp8)
SHAPES: dict[str, tuple[int, dict | None, str | None, bool]] = {
    "one": (1, None, None, False),  # one plain process: the "full" layout, optimizer keyed by index
    "one_fsdp": (1, None, SHARDED, False),  # FSDP's plugin on one process: "dcp"
    "one_fsdp_full": (1, None, FULL, False),  # "full", the optimizer keyed by parameter names
    "one_fp8": (1, None, None, True),
    "ddp2": (2, None, None, False),
    "fsdp2": (2, None, SHARDED, False),
    "fsdp2_full": (2, None, FULL, False),
    "pp2": (2, {"pp_size": 2}, None, False),
    "tp2": (2, {"tp_size": 2}, SHARDED, False),
    "fsdp2_fp8": (2, None, SHARDED, True),
    "fsdp4": (4, None, SHARDED, False),
    "hsdp2x2": (4, {"dp_replicate_size": 2, "dp_shard_size": 2}, SHARDED, False),
    "tp2_fsdp2": (4, {"dp_shard_size": 2, "tp_size": 2}, SHARDED, False),
    "pp2_fsdp2": (4, {"pp_size": 2, "dp_shard_size": 2}, None, False),
    "pp2_tp2": (4, {"pp_size": 2, "tp_size": 2}, None, False),
}


def accelerator(shape: str) -> Accelerator:
    _, mesh, state_dict_type, fp8 = SHAPES[shape]
    kwargs: dict = {"cpu": True, "mixed_precision": "fp8" if fp8 else None}
    if state_dict_type is not None:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(state_dict_type=state_dict_type)
    if mesh is not None:
        tp = mesh.get("tp_size", 1) > 1
        kwargs["parallelism_config"] = ParallelismConfig(**mesh, tp_plan=TP_PLAN if tp else None)
    return Accelerator(**kwargs)


def batches() -> list:
    """Four batches, the same on every process."""
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    return [b for _, b in zip(range(4), loader)]


def prepared(shape: str, seed: int) -> tuple:
    acc = accelerator(shape)
    torch.manual_seed(seed)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def steps(acc: Accelerator, model, opt, data: list) -> list[float]:
    losses = []
    for x, y in data:
        losses.append(float(acc.pipeline_step(model, x, y, loss_fn)))  # without a pipeline: forward + backward
        opt.step()
        opt.zero_grad()
    return losses


def weights(acc: Accelerator, model) -> dict[str, torch.Tensor]:
    """The whole model's weights on the main process (empty elsewhere)."""
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def save(shape: str, out_dir: str) -> None:
    acc, model, opt = prepared(shape, 0)
    data = batches()
    steps(acc, model, opt, data[:2])
    folder = os.path.join(out_dir, shape)
    acc.save_state(folder)
    saved = weights(acc, model)
    losses = steps(acc, model, opt, data[2:])
    after = weights(acc, model)
    if acc.is_main_process:
        torch.save({"saved": saved, "after": after, "losses": losses, "fp8": SHAPES[shape][3]}, folder + ".pt")
    acc.wait_for_everyone()


def max_diff(a: dict, b: dict) -> float | None:
    if not a:
        return None
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def load(folder: str, shape: str) -> dict:
    """``folder`` loaded at ``shape``: the weight difference to the saved ones (main process),
    the next steps' losses and the saving run's, the weights after them against its."""
    expected = torch.load(folder + ".pt")
    acc, model, opt = prepared(shape, 100)
    acc.load_state(folder)
    loaded = weights(acc, model)
    losses = steps(acc, model, opt, batches()[2:])
    return {
        "weight_diff": max_diff(loaded, expected["saved"]),
        "losses": losses,
        "expected": expected["losses"],
        "after_diff": max_diff(weights(acc, model), expected["after"]),
        "same_precision": expected["fp8"] == SHAPES[shape][3],
    }


def checkpoints(dirs: list[str]) -> list[str]:
    return [os.path.join(d, name) for d in dirs for name in SHAPES if os.path.isfile(os.path.join(d, name + ".pt"))]


def shapes_of(n: int) -> list[str]:
    return [s for s, spec in SHAPES.items() if spec[0] == n and _wanted(s)]


def subset_pairs() -> list[tuple[str, str]]:
    """The pairs of the quick matrix: each shape loaded at the next shape of its number of
    processes, and each shape of several processes at one plain process."""
    pairs = []
    for n in (1, 2, 4):
        mine = shapes_of(n)
        pairs += [(s, mine[(i + 1) % len(mine)]) for i, s in enumerate(mine)]
        pairs += [(s, "one") for s in mine if n > 1]
    return pairs


def run(out_dir: str, do_save: bool, sources: list[str], n: int, subset: bool = False) -> dict:
    """Save at every shape of ``n`` processes (``do_save``), then load every checkpoint of
    ``out_dir`` and ``sources`` at each (``subset``: only the pairs of ``subset_pairs``); the
    results by pair."""
    mine = shapes_of(n)
    results: dict = {}
    for shape in mine if do_save else []:
        try:
            save(shape, out_dir)
        except Exception:  # noqa: BLE001 - recorded, the test shows it
            results[f"save:{shape}"] = {"error": traceback.format_exc()}
    wanted = set(subset_pairs()) if subset else None
    for folder in checkpoints([out_dir, *sources]):
        for shape in mine:
            key = f"{os.path.basename(folder)}->{shape}"
            if wanted is not None and (os.path.basename(folder), shape) not in wanted:
                continue
            try:
                results[key] = load(folder, shape)
            except Exception:  # noqa: BLE001
                results[key] = {"error": traceback.format_exc()}
    return results


def _wanted(shape: str) -> bool:
    only = set(filter(None, os.environ.get("MATRIX_ONLY", "").split(",")))  # for development: a few shapes
    return not only or shape in only


if __name__ == "__main__":
    out, flag, pairs, *dirs = sys.argv[1:]
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    res = run(out, flag == "1", dirs, world, subset=pairs == "subset")
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(res, f)
    if dist.is_initialized():
        dist.destroy_process_group()
