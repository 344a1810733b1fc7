"""Writing a ``SavePlan``: the writes themselves (``write_file``, ``write_sharded``) and ``Executor``,
which runs a whole save now (a synchronous ``save_state``).

Every file is hashed as it is written (``files.recording``), so the manifest needs no pass over
the files. The sharded folders (``torch.distributed.checkpoint``, every process together) are
written unsynced and fsynced together at the end (``sync_all``): DCP's writer would fsync each
folder's file as soon as it is written, and every process would wait there for the slowest disk
before the next folder's plan; synced once at the end, the disk writes the first folder back
while the next one is written, and the checkpoint is as durable when the manifest is written
(after every process's writes finished). At a URL, likewise, each folder's files upload while
the next folder is serialized (``uploads_later``), every upload ended before ``sync_all``.

``background.BackgroundExecutor`` runs the same plan from a host copy, in a writer thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import dcp_io, errors, files, uploads, weights
from hasten.checkpoint.plans import FileWrite, SavePlan, ShardedWrite, Written

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.commit import Transaction
    from hasten.checkpoint.context import Checkpointable


def write_file(tmp: str, item: FileWrite, obj: Any) -> dict[str, str]:
    """``obj`` (``item.obj`` or its host copy) written as ``item`` says into ``tmp``; ``{name: path}``."""
    path = os.path.join(tmp, item.name)
    if item.kind == "weights":
        weights.write_weights(path, obj, item.safe, "save_state")
    elif item.kind == "json":
        files.write_json(path, obj)
    else:
        files.write(path, lambda f: torch.save(obj, f))
    return {item.name: path}


def write_sharded(
    plans_key: str, tmp: str, item: ShardedWrite, state_dict: Any, unsynced: list[str], group: Any = None
) -> dict[str, str]:
    """This process's files of ``state_dict`` (``item.state_dict`` or its host copy) in
    ``tmp/item.folder``, with torch's planner (its plans cached per folder under ``plans_key``: a
    later save of the same shapes skips planning) over ``group`` (the default one where None),
    left unsynced: their paths (and the folder's) are added to ``unsynced``, for ``sync_all``.
    Returns ``{folder/file name: path}``."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    folder = item.folder
    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = f"{plans_key}:{folder}"
    writer = dcp_io.dcp_writer(os.path.join(tmp, folder), sync_files=False)
    dcp_io.dcp().save(state_dict, storage_writer=writer, planner=planner, process_group=group, no_dist=dcp_io.no_dist())
    unsynced.extend([*writer.hasten_files, os.path.join(tmp, folder)])
    return {f"{folder}/{os.path.basename(p)}": p for p in writer.hasten_files}


def sync_all(unsynced: list[str]) -> dict[str, str]:
    """fsync every file (and folder) the sharded writes before it left unsynced; ``{}``."""
    files.fsync_files(unsynced)
    unsynced.clear()
    return {}


def records(recorded: dict[str, dict[str, Any]], written: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{file name: size and checksum}`` of ``written`` (``{name: path}``), as hashed while written."""
    return {name: files.recorded(recorded, path) for name, path in written.items()}


# At a URL, inside ``uploads_later()``: the most uploads of a save sent at once.
UPLOADS_AT_ONCE = 4


class _Later:
    """The uploads ``uploads.Upload`` sent in one ``uploads_later()``, on a few threads of their own."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(UPLOADS_AT_ONCE, thread_name_prefix="hasten-uploads")
        self.sent: list[Any] = []

    def send(self, fs: Any, path: str, data: bytes) -> None:
        self.sent.append(self.pool.submit(_pipe, fs, path, data))

    def join(self) -> None:
        """Wait for every upload sent; raise the first one's error (after all of them ended)."""
        try:
            failed = [e for e in (f.exception() for f in self.sent) if e is not None]
        finally:
            self.pool.shutdown(wait=True)
        if failed:
            raise failed[0]


def _pipe(fs: Any, path: str, data: bytes) -> None:
    """``fs.pipe_file(path, data)``; an OS failure names ``path``, as a write's does (``files.naming_os_errors``)."""
    try:
        fs.pipe_file(path, data)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from None
        raise


@contextlib.contextmanager
def uploads_later() -> Iterator[None]:
    """Within (in this thread): each ``uploads.Upload`` is sent at its ``close`` and its upload goes
    on while the caller goes on (the next DCP folder serialized while the previous one uploads);
    at the end every upload sent has ended, and the first one's error is raised there (where the
    block raised, its error, once they ended). Nothing is uploaded after the block."""
    if uploads.later.get() is not None:
        yield
        return
    sender = _Later()
    token = uploads.later.set(sender)
    try:
        yield
    except BaseException:
        uploads.later.reset(token)
        with contextlib.suppress(Exception):
            sender.join()
        raise
    uploads.later.reset(token)
    sender.join()


class Executor:
    """Runs a save now: every process writes its plan, then the main process commits."""

    def __init__(self, ctx: Checkpointable, plans_key: str) -> None:
        self.ctx, self.plans_key = ctx, plans_key

    def write(self, plan: SavePlan, tmp: str) -> Written:
        """The whole plan, now: the sharded folders (every process, together), then the files."""
        written: dict[str, str] = {}
        unsynced: list[str] = []
        with files.recording() as recorded:
            # at a URL each folder uploads while the next one is serialized; every upload ends here
            with uploads_later():
                for item in plan.sharded:
                    written.update(write_sharded(self.plans_key, tmp, item, item.state_dict, unsynced))
            if plan.sharded:
                sync_all(unsynced)
            for item in plan.files:
                written.update(write_file(tmp, item, item.obj))
        return Written(records(recorded, written), plan.manifest)

    def run(self, txn: Transaction, plan: Callable[[], SavePlan]) -> None:
        """The save of ``txn``: make its folder, ``plan()`` (the pre-hooks, the layout's plan) and
        write it on every process, commit; each step agreed by every process (a failure anywhere
        is one everywhere, and the temporary folder is removed)."""
        ctx = self.ctx
        try:
            begin(ctx, txn)
            planned = ctx.agree("save_state (planning)", txn.explained(plan))  # all that can fail before a byte
            replace_previous(ctx, txn)
            write = txn.explained(lambda: (txn.upload_hook_files(), self.write(planned, txn.tmp))[1])
            reports = ctx.agree("save_state (writing)", write, share=True)
            ctx.agree("save_state (finalising)", txn.explained(lambda: txn.commit(reports)))
        except BaseException as e:
            txn.end(failed=True)
            same = errors.agreed(e)  # every process raises the same type
            if same is e:
                raise
            raise same from e
        txn.end(failed=False)


def begin(ctx: Checkpointable, txn: Transaction) -> None:
    """``txn.begin``, agreed by every process, each told whether there is a previous copy to replace."""
    found = ctx.agree("save_state (creating the temporary directory)", txn.explained(txn.begin), True)
    txn.previous_anywhere = any(found)


def replace_previous(ctx: Checkpointable, txn: Transaction, group: Any = None) -> None:
    """At a URL, once the plan is built: the previous copy deleted (``Transaction.replace``), every
    process told whether it was (what a failure from here says became of it). Nothing on the disk,
    nor where ``begin`` found no previous copy (no collective)."""
    if txn.store.url and txn.previous_anywhere:
        deleted = ctx.agree("save_state (replacing the previous copy)", txn.explained(txn.replace), True, group)
        txn.replaced = any(deleted)


def forget_plans(plans_key: str) -> None:
    """Drop the save plans cached under ``plans_key`` from torch's plan cache (class-wide dicts:
    kept until then)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    prefix = f"{plans_key}:"
    for cache in (getattr(SavePlanner, n, None) for n in ("_cached_save_plan", "_cached_all_plans",
                  "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan")):  # fmt: skip
        if isinstance(cache, dict):
            for key in [k for k in cache if isinstance(k, str) and k.startswith(prefix)]:
                del cache[key]
