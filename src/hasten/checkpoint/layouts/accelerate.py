"""Hugging Face Accelerate's ``save_state`` folders, read (never written) by ``load_state``.

A team that switches mid-project has only Accelerate's checkpoints::

    model.safetensors, model_1.safetensors ...   (or pytorch_model.bin, pytorch_model_1.bin ...)
    optimizer.bin, optimizer_1.bin ...           scheduler.bin, scheduler_1.bin ...
    scaler.pt                                    custom_checkpoint_0.pkl ...
    random_states_0.pkl ... random_states_N.pkl  (per process: Python, NumPy, torch, CUDA states
                                                  and Accelerate's accumulation counter "step")
    sampler.bin, dl_state_dict.bin               (not read: see below)

No model file at all is fine when a ``register_save_state_pre_hook`` took the weights out at the
save (diffusers' scripts save ``unet/`` themselves) and a load pre-hook takes the models out here.

Everything is read with ``torch.load(weights_only=True)``; the RNG files need a few NumPy
types, which are allowed by name for that file only (``names.rng_types``); anything else in any
file is refused with the file and what it asked for named (``unpickle.torch_load``), and
nothing of it runs. What does not carry over: the position in the data
(Accelerate does not record where an epoch stood, so prepared dataloaders start their epoch
from the beginning) and ``accelerator.step``, which counts from 0 again (Accelerate's "step"
is its accumulation counter; it sets the accumulation micro-step here).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import restore
from hasten.checkpoint.layouts.names import RNG_FILE, as_hasten_rng, hasten_wrote, numbered, read_rng_file
from hasten.checkpoint.plans import Restore
from hasten.checkpoint.weights import compare_tensors, read_weights, tensor_table
from hasten.strategies import own_keys
from hasten.training.rng import check_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions, SavePlan


def _count(names: set[str], stem: str, ext: str) -> int:
    """How many of ``stem.ext``, ``stem_1.ext`` ... are among ``names``, one after another."""
    n = 0
    while numbered(stem, ext, n) in names:
        n += 1
    return n


_HINT = (
    "; it holds objects other than tensors and plain containers, which are not loaded "
    "(load_state(..., weights_only=False) reads a trusted checkpoint)"
)


class AccelerateLayout:
    name = "accelerate"
    writable = False

    def recognises(self, directory: str) -> bool:
        """A folder with the main process's random states, ``random_states_0.pkl``: the file its
        ``save_state`` writes after the model, optimizer, scheduler and scaler files. A model file
        is not required: a save hook may take the weights and write them itself (diffusers' scripts
        write ``unet/``), leaving optimizer, scheduler and random states. Not a folder hasten wrote
        in Accelerate's names (``names.hasten_wrote``): without its manifest, that is a save that did
        not finish, never a checkpoint."""
        return os.path.isfile(os.path.join(directory, "random_states_0.pkl")) and not hasten_wrote(directory)

    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        raise NotImplementedError("hasten reads Accelerate's checkpoints but writes its own layout")

    def plan_save(self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool) -> SavePlan:
        raise NotImplementedError("hasten reads Accelerate's checkpoints but writes its own layout")

    # ------------------------------------------------------------------ read
    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        options: LoadOptions,
    ) -> Restore:
        """At another number of processes than saved, Accelerate's per-process random states
        (``random_states_N.pkl``) are not restored (the generators stay as they are); with
        ``strict_world_size=True`` that is an error instead."""
        where = f"the Accelerate checkpoint {directory!r}"
        names = set(os.listdir(directory))
        registry, state = ctx.registry, ctx.state
        load = restore.torch_files(
            directory, where, options.weights_only, _HINT if options.weights_only else "", brief=True
        )
        r = Restore(where)
        _read_models(ctx, directory, names, models, r, options.weights_only)
        for kind, stem, objects in (
            ("optimizers", "optimizer", registry.optimizers),
            ("schedulers", "scheduler", registry.schedulers),
        ):
            if _count(names, stem, ".bin") != len(objects):
                raise ValueError(f"{where} holds {_count(names, stem, '.bin')} {kind}, but {len(objects)} are prepared")
            setattr(r, kind, [load(numbered(stem, ".bin", i)) for i in range(len(objects))])
        for i, (opt, sd) in enumerate(zip(registry.optimizers, r.optimizers)):
            restore.check_param_groups(i, opt, sd, where)
        custom = sorted(n for n in names if re.fullmatch(r"custom_checkpoint_\d+\.pkl", n))
        if len(custom) != len(registry.custom_objects):
            raise ValueError(
                f"{where} holds {len(custom)} registered object(s), but {len(registry.custom_objects)} are registered"
            )
        r.custom = [load(f"custom_checkpoint_{i}.pkl") for i in range(len(custom))]
        has_scaler = ctx.precision.scaler is not None
        if has_scaler != ("scaler.pt" in names):
            raise ValueError(
                f"{where} was saved {'with' if 'scaler.pt' in names else 'without'} a GradScaler (scaler.pt), but this "
                f"Accelerator has mixed_precision={ctx.precision.mode!r} {'with' if has_scaler else 'without'} one"
            )
        r.scaler = {"scaler": load("scaler.pt")} if has_scaler else None
        world = sorted(int(m.group(1)) for m in map(RNG_FILE.fullmatch, names) if m)
        rng_file = f"random_states_{state.process_index}.pkl"
        if len(world) != state.num_processes or rng_file not in names:
            if not options.strict_world_size:  # the RNG states are per process: they stay as they are
                return r
            raise ValueError(
                f"{where} was saved by {len(world)} process(es) (random_states_*.pkl) but this run has "
                f"{state.num_processes}; resume it with the same number of processes, or leave "
                "strict_world_size at False to load everything but the per-process random states"
            )
        rng = read_rng_file(load, rng_file, where)
        r.rng = as_hasten_rng(rng, f"{where} ({rng_file})")
        try:
            check_rng_state(r.rng, f"{where} ({rng_file})")
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        r.micro_step = int(rng.get("step", 0)) % max(ctx.gradient_state.num_steps, 1)
        return r

    def restore(self, ctx: Checkpointable, r: Restore, directory: str, models: list[torch.nn.Module]) -> None:
        restore.apply(ctx, r, directory, models, guarded=False)


def _read_models(
    ctx: Checkpointable, directory: str, names: set[str], models: list[torch.nn.Module], r: Restore, weights_only: bool
) -> None:
    """Each model's file (``model*.safetensors``, else ``pytorch_model*.bin``) into ``r.models``,
    with the model's own keys and its tied weights, checked against the prepared model."""
    where = r.where
    safe = _count(names, "model", ".safetensors")
    found_models = safe or _count(names, "pytorch_model", ".bin")
    if found_models != len(models):
        raise ValueError(
            f"{where} holds the weights of {found_models} model(s), but {len(models)} are prepared "
            "(less those the load_state pre-hooks took out)"
        )
    for i, model in enumerate(models):
        file_name = numbered("model", ".safetensors", i) if safe else numbered("pytorch_model", ".bin", i)
        weights = read_weights(os.path.join(directory, file_name), weights_only)
        current = ctx.strategy.model_state_dict(model, check_filled=False)
        weights = _tied(own_keys(weights, current.keys()), current)
        compare_tensors(tensor_table(weights), tensor_table(current), f"{where} ({file_name})")
        r.models.append(weights)


def _tied(weights: dict[str, torch.Tensor], current: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Accelerate stores tied weights once (safetensors cannot share storage): give the names it
    left out the tensor of the name they are tied to in the model."""
    missing = [k for k in current if k not in weights]
    if not missing:
        return weights
    by_storage: dict[tuple, str] = {}
    for name, t in current.items():
        if isinstance(t, torch.Tensor) and name in weights and t.numel():
            by_storage.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), name)
    out = dict(weights)
    for name in missing:
        t = current[name]
        if isinstance(t, torch.Tensor) and t.numel():
            twin = by_storage.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
            if twin is not None:
                out[name] = out[twin]
    return out


LAYOUT = AccelerateLayout()
