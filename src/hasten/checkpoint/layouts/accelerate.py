"""Hugging Face Accelerate's ``save_state`` folders, read (never written) by ``load_state``.

A team that switches mid-project has only Accelerate's checkpoints::

    model.safetensors, model_1.safetensors ...   (or pytorch_model.bin, pytorch_model_1.bin ...)
    optimizer.bin, optimizer_1.bin ...           scheduler.bin, scheduler_1.bin ...
    scaler.pt                                    custom_checkpoint_0.pkl ...
    random_states_0.pkl ... random_states_N.pkl  (per process: Python, NumPy, torch, CUDA states
                                                  and Accelerate's accumulation counter "step")
    sampler.bin, dl_state_dict.bin               (not read: see below)

Everything is read with ``torch.load(weights_only=True)``; the RNG files need a few NumPy
types, which are allowed by name for that file only (``_rng_types``); anything else in any
file is refused with the file and what it asked for named (``unpickle.torch_load``), and
nothing of it runs. What does not carry over: the position in the data
(Accelerate does not record where an epoch stood, so prepared dataloaders start their epoch
from the beginning) and ``accelerator.step``, which counts from 0 again (Accelerate's "step"
is its accumulation counter; it sets the accumulation micro-step here).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...rng import check_rng_state, restore_rng_state
from ...strategies import own_keys
from .. import io, unpickle
from ..errors import UnsafeCheckpoint
from .full import restore_custom_objects

if TYPE_CHECKING:  # pragma: no cover
    from ..context import Checkpointable

_RNG = re.compile(r"random_states_(\d+)\.pkl")


def _numbered(stem: str, ext: str, i: int) -> str:
    return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"


def _count(names: set[str], stem: str, ext: str) -> int:
    """How many of ``stem.ext``, ``stem_1.ext`` ... are among ``names``, one after another."""
    n = 0
    while _numbered(stem, ext, n) in names:
        n += 1
    return n


def _rng_types() -> list[Any]:
    """The NumPy globals an Accelerate RNG file holds (an array of uint32 and its dtype)."""
    import codecs

    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    types: list[Any] = [np.ndarray, np.dtype, codecs.encode]
    # The reconstructor under both of its module names (files written with NumPy 1 or 2).
    types += [(multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
              (multiarray._reconstruct, "numpy._core.multiarray._reconstruct")]
    if hasattr(np, "dtypes"):
        types.append(np.dtypes.UInt32DType)
    return types


@contextlib.contextmanager
def _allowing(types: list[Any]) -> Iterator[None]:
    with torch.serialization.safe_globals(types):
        yield


def _loader(directory: str, where: str, weights_only: bool) -> Any:
    """``load(file name, allow=None)``: a torch file of the folder through torch's allow-list
    (with ``weights_only``; ``allow``: more globals, for that file only); a file asking for
    more is an ``UnsafeCheckpoint`` naming it and what it asked for, any other failure a
    ValueError naming the file."""
    hint = (
        "; it holds objects other than tensors and plain containers, which are not loaded "
        "(load_state(..., weights_only=False) reads a trusted checkpoint)" if weights_only else ""
    )

    def load(file_name: str, allow: list[Any] | None = None) -> Any:
        path = os.path.join(directory, file_name)
        try:
            with _allowing(allow) if allow and weights_only else contextlib.nullcontext():
                return unpickle.torch_load(path, f"{where}: cannot read {file_name!r}", weights_only, hint)
        except UnsafeCheckpoint:
            raise
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"{where}: cannot read {file_name!r} ({type(e).__name__}: {first}){hint}") from e

    return load


class AccelerateLayout:
    name = "accelerate"
    writable = False

    def recognises(self, directory: str) -> bool:
        names = set(os.listdir(directory))
        has_model = "model.safetensors" in names or "pytorch_model.bin" in names
        return has_model and any(_RNG.fullmatch(n) for n in names)

    def write(self, ctx: Checkpointable, tmp: str, weights: list[dict[str, Any]], *, safe: bool = True, stage: Any = None) -> Any:
        raise NotImplementedError("hasten reads Accelerate's checkpoints but writes its own layout")

    # ------------------------------------------------------------------ read
    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        weights_only: bool,
        verify_checksums: bool,
        strict_world_size: bool = False,
    ) -> dict[str, Any]:
        """At another number of processes than saved, Accelerate's per-process random states
        (``random_states_N.pkl``) are not restored (the generators stay as they are); with
        ``strict_world_size=True`` that is an error instead."""
        where = f"the Accelerate checkpoint {directory!r}"
        names = set(os.listdir(directory))
        registry, state = ctx.registry, ctx.state

        load = _loader(directory, where, weights_only)

        def count(stem: str, ext: str) -> int:
            return _count(names, stem, ext)

        out: dict[str, Any] = {"models": [], "optimizers": [], "schedulers": [], "custom": []}
        safe = count("model", ".safetensors")
        found_models = safe or count("pytorch_model", ".bin")
        if found_models != len(models):
            raise ValueError(
                f"{where} holds the weights of {found_models} model(s), but {len(models)} are prepared "
                "(less those the load_state pre-hooks took out)"
            )
        for i, model in enumerate(models):
            file_name = _numbered("model", ".safetensors", i) if safe else _numbered("pytorch_model", ".bin", i)
            weights = io.read_weights(os.path.join(directory, file_name), weights_only)
            current = ctx.strategy.model_state_dict(model, check_filled=False)
            weights = _tied(own_keys(weights, current.keys()), current)
            io.compare_tensors(io.tensor_table(weights), io.tensor_table(current), f"{where} ({file_name})")
            out["models"].append(weights)
        for kind, stem, objects in (("optimizers", "optimizer", registry.optimizers),
                                    ("schedulers", "scheduler", registry.schedulers)):
            if count(stem, ".bin") != len(objects):
                raise ValueError(f"{where} holds {count(stem, '.bin')} {kind}, but {len(objects)} are prepared")
            out[kind] = [load(_numbered(stem, ".bin", i)) for i in range(len(objects))]
        for i, (opt, sd) in enumerate(zip(registry.optimizers, out["optimizers"])):
            saved = [len(g["params"]) for g in sd.get("param_groups", [])]
            now = [len(g["params"]) for g in opt.param_groups]
            if saved != now:
                raise ValueError(f"{where}: optimizer {i} has parameter groups of sizes {saved}, the prepared one {now}")
        custom = sorted(n for n in names if re.fullmatch(r"custom_checkpoint_\d+\.pkl", n))
        if len(custom) != len(registry.custom_objects):
            raise ValueError(
                f"{where} holds {len(custom)} registered object(s), but {len(registry.custom_objects)} are registered"
            )
        out["custom"] = [load(f"custom_checkpoint_{i}.pkl") for i in range(len(custom))]
        has_scaler = ctx.precision.scaler is not None
        if has_scaler != ("scaler.pt" in names):
            raise ValueError(
                f"{where} was saved {'with' if 'scaler.pt' in names else 'without'} a GradScaler (scaler.pt), but this "
                f"Accelerator has mixed_precision={ctx.precision.mode!r} {'with' if has_scaler else 'without'} one"
            )
        out["scaler"] = {"scaler": load("scaler.pt")} if has_scaler else None
        world = sorted(int(m.group(1)) for m in map(_RNG.fullmatch, names) if m)
        rng_file = f"random_states_{state.process_index}.pkl"
        out["micro_step"] = 0
        if len(world) != state.num_processes or rng_file not in names:
            if not strict_world_size:  # the RNG states are per process: they stay as they are
                out["rng"] = None
                return out
            raise ValueError(
                f"{where} was saved by {len(world)} process(es) (random_states_*.pkl) but this run has "
                f"{state.num_processes}; resume it with the same number of processes, or leave "
                "strict_world_size at False to load everything but the per-process random states"
            )
        rng = _read_rng(load, rng_file, where)
        out["rng"] = _as_hasten_rng(rng, f"{where} ({rng_file})")
        try:
            check_rng_state(out["rng"], f"{where} ({rng_file})")
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        out["micro_step"] = int(rng.get("step", 0)) % max(ctx.gradient_state.num_steps, 1)
        return out

    def restore(self, ctx: Checkpointable, data: dict[str, Any], directory: str, models: list[torch.nn.Module]) -> None:
        restore_custom_objects(ctx.registry.custom_objects, data["custom"], directory)
        for model, sd in zip(models, data["models"]):
            ctx.strategy.load_model_state_dict(model, sd)
        for opt, sd in zip(ctx.registry.optimizers, data["optimizers"]):
            ctx.strategy.load_optimizer_state_dict(opt, sd)
        for sched, sd in zip(ctx.registry.schedulers, data["schedulers"]):
            sched.load_state_dict(sd)
        if data["scaler"] is not None:
            ctx.precision.load_state_dict(data["scaler"])
        ctx.gradient_state.micro_step = data["micro_step"]
        if data["rng"] is not None:
            restore_rng_state(data["rng"], f"the Accelerate checkpoint {directory!r}")


def _read_rng(load: Any, rng_file: str, where: str) -> Any:
    """Accelerate's random-state file ``rng_file``, with the NumPy types it needs allowed."""
    try:
        allow = _rng_types()
    except ImportError:
        raise ValueError(f"{where}: {rng_file!r} holds NumPy's random state, but NumPy is not installed here") from None
    return load(rng_file, allow)


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


def _as_hasten_rng(states: Any, where: str) -> dict[str, Any]:
    """Accelerate's RNG file, in the form ``hasten.rng.restore_rng_state`` takes."""
    if not isinstance(states, dict) or "random_state" not in states or "torch_manual_seed" not in states:
        raise ValueError(f"{where} holds no random states")
    try:
        version, internal, gauss = states["random_state"]
        out: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss": gauss},
                               "torch": states["torch_manual_seed"]}
        if "numpy_random_seed" in states:
            kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
            out["numpy"] = {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        if "torch_cuda_manual_seed" in states:
            out["cuda"] = list(states["torch_cuda_manual_seed"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the random states are not in Accelerate's form ({e})") from e
    return out


LAYOUT = AccelerateLayout()
