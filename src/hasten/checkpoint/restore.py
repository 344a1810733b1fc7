"""Putting a read checkpoint back (``apply``), and the readers every layout's ``read`` shares.

``apply`` puts a ``plans.Restore`` into the objects, in one order for every layout: the
registered objects first (user code: if one refuses its state, those restored before it are put
back and nothing else has changed), then the models, optimizers (and their step counters),
schedulers (after those counters: a scheduler counts their real steps), the GradScaler, the
accumulation micro-step, the dataloaders' positions and the RNG states.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import unpickle
from hasten.checkpoint.errors import UnsafeCheckpoint
from hasten.training.rng import restore_rng_state, set_seed

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import Restore


def apply(ctx: Checkpointable, r: Restore, directory: str, models: list[torch.nn.Module], guarded: bool = True) -> None:
    """Put ``r`` into the objects; ``r.rng`` None: the RNG states are those of ``r.derived_seed``
    where it is set, else left as they are. ``guarded``: a failure after the registered objects
    is a RuntimeError naming the step and saying that what came before it was changed (hasten's
    layouts); else it is raised as it is (Accelerate's)."""
    restore_custom_objects(ctx.registry.custom_objects, r.custom, directory)
    step = ["models"]
    try:
        _apply_rest(ctx, r, models, step)
    except Exception as e:
        if not guarded:
            raise
        raise RuntimeError(
            f"load_state: restoring the {step[0]} from {directory!r} failed ({type(e).__name__}: {e}); "
            "the objects restored before it were changed, do not continue training from this state"
        ) from e


def _apply_rest(ctx: Checkpointable, r: Restore, models: list[torch.nn.Module], step: list[str]) -> None:
    """``apply`` after the registered objects; ``step[0]`` names the step under way."""
    registry = ctx.registry
    for model, sd in zip(models, r.models):
        ctx.strategy.load_model_state_dict(model, sd)
    step[0] = "optimizers"
    for i, (opt, sd) in enumerate(zip(registry.optimizers, r.optimizers)):
        ctx.strategy.load_optimizer_state_dict(opt, sd)
        if r.optimizer_counters is not None:
            counters = r.optimizer_counters[i]
            opt.real_steps = int(counters["real_steps"])
            opt.sync_steps = int(counters["sync_steps"])
    step[0] = "schedulers"
    for sched, sd in zip(registry.schedulers, r.schedulers):
        sched.load_state_dict(sd)
    step[0] = "grad scaler"
    if r.scaler is not None:
        ctx.precision.load_state_dict(r.scaler)
    step[0] = "loop state"
    ctx.gradient_state.micro_step = int(r.micro_step)
    step[0] = "dataloaders"
    if r.dataloaders is not None:
        for dl, sd in zip(registry.dataloaders, r.dataloaders):
            dl.load_state_dict(sd)
    step[0] = "RNG states"
    if r.rng is not None:
        restore_rng_state(r.rng, r.where)
    elif (
        r.derived_seed is not None
    ):  # a process the saving run did not have: states derived from its seed and this rank
        set_seed(r.derived_seed)


def restore_custom_objects(objects: list[Any], states: list[Any], directory: str) -> None:
    """``load_state_dict`` each registered object; if one raises, put back those done before it."""
    done: list[tuple[Any, Any]] = []
    for i, (obj, sd) in enumerate(zip(objects, states)):
        before = copy.deepcopy(obj.state_dict())
        try:
            obj.load_state_dict(sd)
        except Exception as e:
            for restored, old in reversed(done):
                restored.load_state_dict(old)
            raise ValueError(
                f"load_state: registered object {i} ({type(obj).__name__}) refused its state from {directory!r} "
                f"({type(e).__name__}: {e}); nothing was restored"
            ) from e
        done.append((obj, before))


def check_param_groups(i: int, opt: Any, sd: Any, where: str) -> None:
    """The saved state ``sd`` of optimizer ``i`` has the prepared optimizer's parameter group sizes."""
    saved = [len(g["params"]) for g in sd.get("param_groups", [])]
    now = [len(g["params"]) for g in opt.param_groups]
    if saved != now:
        raise ValueError(f"{where}: optimizer {i} has parameter groups of sizes {saved}, the prepared one {now}")


@contextlib.contextmanager
def _allowing(types: list[Any]) -> Iterator[None]:
    with torch.serialization.safe_globals(types):
        yield


def torch_files(directory: str, where: str, weights_only: bool, hint: str, brief: bool = False) -> Callable[..., Any]:
    """``load(file name, allow=None)``: a torch file of ``directory`` through torch's allow-list
    with ``weights_only`` (``allow``: more globals, for that file only); a file asking for more
    is an ``UnsafeCheckpoint`` naming it and what it asked for, any other failure a ValueError
    naming the file, with ``hint`` (the error's first line in brackets with ``brief``)."""

    def load(file_name: str, allow: list[Any] | None = None) -> Any:
        path = os.path.join(directory, file_name)
        try:
            with _allowing(allow) if allow and weights_only else contextlib.nullcontext():
                return unpickle.torch_load(path, f"{where}: cannot read {file_name!r}", weights_only, hint)
        except UnsafeCheckpoint:
            raise
        except Exception as e:
            if brief:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                raise ValueError(f"{where}: cannot read {file_name!r} ({type(e).__name__}: {first}){hint}") from e
            raise ValueError(f"{where}: cannot read {file_name!r}: {type(e).__name__}: {e}{hint}") from e

    return load
