"""Putting a read checkpoint back (``apply``), and the readers every layout's ``read`` shares.

``apply`` puts a ``plans.Restore`` into the objects, in one order for every layout: the
registered objects first (user code: if one refuses its state, those restored before it are put
back and nothing else has changed), then the optimizers (and their step counters), the models
(after the optimizers: torch's loading of an optimizer state is the step most likely to refuse
what it gets, and a refusal then leaves the models as they were), schedulers (after those
counters: a scheduler counts their real steps), the GradScaler, the accumulation micro-step, the
dataloaders' positions and the RNG states.

Before that, a layout's ``read`` matches everything against its target (read -> match -> set):
each model's tensor names and shapes (``weights.compare_tensors``), and each optimizer's state
(``match_optimizer``): its parameter groups by parameter names (a state keyed by index, torch's
own, is keyed by the prepared optimizer's names first), the state's keys per parameter (those of
the prepared optimizer's class and settings) and the shapes of its tensors. So a checkpoint of
one process or DDP loads into FSDP, tensor or pipeline parallelism and back, and one of another
optimizer is an error naming what differs, with nothing changed.
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
from hasten.strategies.base import by_names
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
    step = ["optimizers"]
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
    if r.fault_tolerance is not None:
        step[0] = "fault tolerance state"
        ctx.fault_tolerance.load_state_dict(r.fault_tolerance)
    step[0] = "optimizers"
    for opt, sd in zip(registry.optimizers, r.optimizers):
        ctx.strategy.load_optimizer_state_dict(opt, sd)
    step[0] = "models"
    for model, sd in zip(models, r.models):
        ctx.strategy.load_model_state_dict(model, sd)
    step[0] = "optimizers"
    for opt, counters in zip(registry.optimizers, r.optimizer_counters or []):
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


def match_optimizer(
    i: int,
    sd: Any,
    names: list[list[str]],
    keys: list[set[str] | None],
    shapes: dict[str, list[int]],
    where: str,
) -> dict[str, Any]:
    """The saved state ``sd`` of optimizer ``i``, keyed by parameter names, once it matches the
    prepared optimizer: ``names``, each group's parameter names (the whole model's); ``keys``,
    each group's state keys per parameter (None: not known); ``shapes``, the parameters' whole
    shapes. A difference is a ValueError saying what differs."""
    what = f"{where}: optimizer {i}"
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("param_groups"), list)
        or not isinstance(sd.get("state"), dict)
    ):
        raise ValueError(f"{what} is not an optimizer state dict (no 'state' and 'param_groups')")
    sd = by_names(sd, names, what)
    saved = [[str(n) for n in g.get("params", [])] for g in sd["param_groups"]]
    if [sorted(g) for g in saved] != [sorted(g) for g in names]:
        have, want = {n for g in saved for n in g}, {n for g in names for n in g}
        raise ValueError(
            f"{what} has parameter groups of sizes {[len(g) for g in saved]}, the prepared optimizer "
            f"{[len(g) for g in names]}; only in the checkpoint: {sorted(have - want)[:5]}, only in the prepared "
            f"optimizer: {sorted(want - have)[:5]}"
        )
    group_of = {n: g for g, group in enumerate(names) for n in group}
    for name, entry in sd["state"].items():
        expected = keys[group_of[name]] if name in group_of and group_of[name] < len(keys) else None
        if name not in group_of or not isinstance(entry, dict):
            raise ValueError(f"{what} holds a state for {name!r}, which the prepared optimizer does not update")
        if expected is not None and set(entry) != expected:
            raise ValueError(
                f"{what}: the state of {name!r} has the keys {sorted(entry)}, the prepared optimizer's "
                f"{sorted(expected)} (another optimizer class or settings than saved)"
            )
        for key, t in entry.items():
            shape = shapes.get(name)
            if isinstance(t, torch.Tensor) and shape is not None and t.dim() == len(shape) and list(t.shape) != shape:
                raise ValueError(
                    f"{what}: the state {key!r} of {name!r} has the shape {list(t.shape)}, the parameter {shape}"
                )
    return sd


def state_keys(optimizer: Any) -> list[set[str] | None]:
    """Each parameter group's state keys per parameter, without changing ``optimizer``: those
    of its state where it has stepped, else those a copy of its class and group settings makes
    on one zero-gradient step of a one-element parameter (None where that copy cannot step)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    out: list[set[str] | None] = []
    for group in opt.param_groups:
        stepped = [opt.state[p] for p in group["params"] if opt.state.get(p)]
        out.append(set(stepped[0]) if stepped else _probe_keys(opt, group))
    return out


def _probe_keys(opt: torch.optim.Optimizer, group: dict[str, Any]) -> set[str] | None:
    first = next(iter(group["params"]), None)
    if first is None:
        return None
    local = first.to_local() if hasattr(first, "to_local") else first
    try:
        p = torch.zeros(1, dtype=local.dtype, device=local.device, requires_grad=True)
        probe = type(opt).__new__(type(opt))
        torch.optim.Optimizer.__init__(probe, [{**group, "params": [p]}], dict(opt.defaults))
        p.grad = torch.zeros_like(p)
        with torch.no_grad():
            probe.step()
        return set(probe.state[p]) if p in probe.state else set()
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied so: its keys are not checked
        return None


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
