"""``save_state`` with torchft's replica groups (FaultToleranceKwargs): one writer per folder.

Each replica group is its own ``hasten launch``; the groups meet only through torchft's process
group, which joins rank r of every group in the quorum (``FaultTolerance.exchange``). A save:

1. every process tells rank r of the other groups its folder, whether it saves asynchronously,
   its committed step and its own part of a checkpoint (``layouts.base.rank_state``: dataloader
   positions, RNG states, seed). Different committed steps: refused on every group, nothing written;
2. of the groups given one folder the lowest writes it, with every group's parts
   (``fault_tolerance_groups_N.pt`` for rank N, which ``layouts.base`` writes from
   ``FaultTolerance.saved_groups`` and from which each group takes its own at ``load_state``);
   the others write nothing. Groups given folders of their own (no filesystem shared) each
   write theirs, each holding every group's parts, so any of them resumes any group;
3. unless a group saves asynchronously, the writer then tells the others whether it wrote, and
   they return once it did, each checking that it sees the folder: a group that does not (one
   path, but no filesystem shared) gets a ``CheckpointError`` saying to give each group a folder
   of its own or one that all see. With ``async_save`` the others return at once (their
   ``wait_for_checkpoint`` has nothing to wait for) and nothing is checked.

A group that joined in a quorum started after the committed step (``optimizer.zero_grad()``
before ``save_state``) reduces its first gradients on that process group meanwhile, so nothing
else may use it: then torchft's participating rank 0 writes its folder with its own parts only
(the others resume from its positions, with a warning at ``load_state``) and the others write
nothing; each warns. Saving before ``zero_grad`` avoids it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hasten.checkpoint import storage
from hasten.checkpoint.errors import CheckpointError, warn_user
from hasten.checkpoint.layouts.base import rank_state
from hasten.checkpoint.manifest import MANIFEST

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable


def save_once(ctx: Checkpointable, target: str, asynchronous: bool, write: Callable[[], None]) -> None:
    """``write`` (the save's transaction: folder, plan, files, commit) where this group writes
    ``target`` for the job, as the module says; nothing on the other groups."""
    ft = ctx.fault_tolerance
    ft.check_savable()  # before anything is exchanged or written
    group = ft.handler.replica_group
    mine = {"group": group, "target": target, "async": asynchronous, "step": ft.step, "state": rank_state(ctx)}
    if ft.handler.num_replica_groups == 1:
        return _write(ft, {group: mine["state"]}, write)
    if not ft.exchange_is_safe():
        writes = ft.manager.participating_rank() == 0
        if ctx.state.is_main_process:
            warn_user(
                f"save_state at step {ft.step}: a replica group joined the quorum started after this step "
                "(optimizer.zero_grad() before save_state), so the groups cannot exchange their positions; "
                + ("this group writes the checkpoint with its own only" if writes else "this group writes nothing")
                + " (call save_state before zero_grad to keep every group's)"
            )
        return _write(ft, {group: mine["state"]}, write) if writes else None
    told = {t["group"]: t for t in _exchange(ft, mine, "their positions")}
    steps = {g: t["step"] for g, t in sorted(told.items())}
    if len(set(steps.values())) > 1:
        raise ValueError(
            f"save_state was called at different committed steps in the replica groups ({steps}, by group): "
            "nothing was written; save at the same accelerator.step in every group (e.g. "
            "`if accelerator.step % N == 0`)"
        )
    writer = min(g for g, t in told.items() if t["target"] == target)
    confirm = not any(t["async"] for t in told.values())  # an asynchronous writer commits later
    if writer == group:
        return _write_and_tell(ft, {g: t["state"] for g, t in told.items()}, write, target, confirm)
    if not confirm:
        return None
    done = {t["group"]: t["done"] for t in _exchange(ft, {"group": group, "done": None}, "whether it wrote")}
    if done.get(writer) != "ok":
        raise CheckpointError(
            f"save_state: replica group {writer}, which writes {target!r} for this group too, failed: "
            f"{done.get(writer)}"
        )
    ctx.agree("save_state (seeing the folder another replica group wrote)", lambda: _check_seen(ctx, target, writer))
    return None


def _write_and_tell(ft: Any, states: dict[int, Any], write: Callable[[], None], target: str, confirm: bool) -> None:
    """The writer's side: ``write``, then (``confirm``) the others told whether it did."""
    group = ft.handler.replica_group
    try:
        _write(ft, states, write)
    except Exception as e:
        if confirm:  # the others learn that it failed and raise; this group raises its own error
            with contextlib.suppress(CheckpointError):
                _exchange(ft, {"group": group, "done": f"{type(e).__name__}: {e}"}, "whether it wrote")
        raise
    if confirm:
        try:
            _exchange(ft, {"group": group, "done": "ok"}, "whether it wrote")
        except CheckpointError as e:  # written all the same: the others raise, not this group
            warn_user(f"{e} (the checkpoint {target!r} is written)")


def _write(ft: Any, states: dict[int, Any], write: Callable[[], None]) -> None:
    ft.saved_groups = states
    try:
        write()
    finally:
        ft.saved_groups = None


def _exchange(ft: Any, mine: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """``ft.exchange(mine)``; its failure a ``CheckpointError`` saying nothing was written."""
    try:
        return ft.exchange(mine)
    except Exception as e:
        raise CheckpointError(
            f"save_state: replica group {ft.handler.replica_group} could not hear from the other replica groups "
            f"{what} ({type(e).__name__}: {e}); did a group fail during the save? Save again at a later step"
        ) from e


def _check_seen(ctx: Checkpointable, target: str, writer: int) -> None:
    """Raise unless this group's main process sees the checkpoint ``writer`` wrote at ``target``."""
    if ctx.state.is_main_process and not storage.exists(storage.of(target).join(target, MANIFEST)):
        raise CheckpointError(
            f"save_state: replica group {writer} wrote {target!r} for every group given that folder, but this "
            "group does not see it: the groups share no filesystem there. Give each group a folder of its own "
            "(each group then writes its own, holding every group's positions) or one that all of them see "
            "(a shared filesystem or a URL)"
        )
