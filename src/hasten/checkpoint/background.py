"""The background executor (``save_state(async_save=True)``): the loop waits for nothing it does
not need; one thread per process writes.

``save_state(async_save=True)`` takes the state dicts on the training loop's thread, copies
there only the tensors that can change before the next optimizer step (the prepared models'
buffers: batch-norm statistics change in forward) and returns. A ``PendingSave`` thread then
copies the parameters and the optimizer state to host memory (``Staging``: torch's
``DefaultStager``, its buffers kept for the next save; pinned memory, on a stream of its own,
where there is a GPU) while the loop runs its next forward and backward, and every prepared
optimizer's next ``step`` waits for that copy before it changes them (the Accelerator's
``barrier.CopyBarrier``, which its optimizers were given at ``prepare``): the same overlap as
torchtitan's, which waits for staging before its optimizer step. The thread then writes the
files (``torch.distributed.checkpoint.save`` of each staged state dict), agrees with every
other process over a gloo group of its own that every write
finished, and the main process writes the manifest and renames the folder into place: the
same steps, in the same order, as a synchronous save, so a crash leaves what it leaves (a
hidden folder without a manifest). The plan is the layout's, as for a synchronous save
(``executor.Executor``): its small files are written before ``save_state`` returns, its large
ones (``FileWrite.large``, and the sharded folders) from the host copies, in the thread, and the
commit is ``commit.Transaction``'s. At most one save is in flight: ``wait`` finishes it and
raises its error; ``save_state``, ``load_state``, ``wait_for_checkpoint`` and ``end_training``
call it, and the thread is not a daemon, so the interpreter's exit waits for it too.

Nothing here waits longer than the run's timeout (``InitProcessGroupKwargs.timeout``, see
``hasten.settings.groups.group_timeout``): the writer's group is made with it, so its collectives fail
once another process has been gone that long (and the thread then ends), and the loop's waits
for the thread (``wait``, and an optimizer step's wait for the copy) raise a ``TimeoutError``
after it rather than hang; a save that timed out stays in flight (nothing else starts, nor is
freed, under it).

Why one thread of ours around ``dcp.save`` rather than ``dcp.async_save``: a checkpoint holds a
DCP folder per model and per optimizer; ``async_save`` gives each call an executor thread of its
own, so two in flight would run their collectives on one group from two threads, in an order
that can differ between processes. One thread keeps them in order, and finishes the checkpoint
(manifest, rename, rotation) after the last one. The staging and the planner (with plan
caching) are torch's. Process-based writing (``AsyncCheckpointerType.PROCESS``) is not used:
on 2 CPU gloo processes under torch.distributed.run (torch 2.13, this project's test machine)
``dcp.async_save(..., async_checkpointer_type=PROCESS)`` of a 4 MB tensor wrote nothing and did
not return within 120 s, nor 300 s; besides, its writer process outlives a SIGKILLed trainer and
would go on writing into the folder, the
staged state is sent to it through a pipe (another copy, in shared memory), each process
spawns an interpreter that imports torch, and the files it wrote are not seen by this process's
hashing writer (see ``dcp_io.dcp_writer``).

The background collectives run on a gloo group made for them (``group``), never the default
group: under NCCL async DCP needs a CPU-capable group (as torchtitan makes one), and on gloo
the training loop's own collectives on the default group would interleave with them.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hasten.checkpoint import files
from hasten.checkpoint.barrier import Copying
from hasten.checkpoint.errors import CheckpointError, agreed, first_line
from hasten.checkpoint.executor import Executor, begin, records, replace_previous, sync_all, write_file, write_sharded
from hasten.checkpoint.plans import ManifestFields, SavePlan, Written

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.barrier import CopyBarrier
    from hasten.checkpoint.commit import Transaction
    from hasten.checkpoint.context import Checkpointable

# For tests: called with the temporary folder's path before each background write (of a DCP
# folder or a file; a test makes it slow, or kills the process there). None in normal runs.
before_write: Callable[[str], None] | None = None
# For tests: called in the writer thread before it copies the parameters and optimizer state
# (a test makes it slow, to see the next optimizer step wait). None in normal runs.
before_stage: Callable[[], None] | None = None

_group: list[Any] = [None, None]  # [the default group it was made for, the gloo group]
_unreported: set[PendingSave] = set()  # saves nobody waited for yet (reported at exit if they failed)


def group() -> Any:
    """The gloo group of every process for background checkpoint collectives (made on first use;
    a collective call, so every process calls it at the same point); None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from hasten.settings.groups import group_timeout

    world = dist.group.WORLD
    if _group[0] is not world:
        _group[:] = [world, dist.new_group(backend="gloo", timeout=group_timeout())]
    return _group[1]


def _new_stager() -> Any:
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Synchronous copies, made in the writer thread (on the ``Staging`` stream where there is a
    # GPU: a blocking copy waits for that stream only); our thread rather than torch's
    # use_async_staging, whose stream does not wait for the training loop's.
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def _spent(stager: Any) -> bool:
    """Whether ``stager`` can stage no more: torch 2.11's and 2.12's ``DefaultStager`` closes its
    ``StateDictStager`` after each ``stage`` (its deepcopy table emptied, so that the next
    ``stage`` fails with ``KeyError: <class 'type'>``); from 2.13 on it stays usable until ``close``."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


class Staging:
    """The host copies of one asynchronous save: ``stage(state_dict)`` (``__call__``) and ``start``
    on the loop's thread, ``run`` in the writer thread, which sets ``done``.

    ``__call__`` returns a ``Future`` of the staged state dict. It copies the structure (dicts,
    lists, tuples: a learning rate set later is not seen) and the tensors that may change before
    the next optimizer step, the prepared models' buffers, now; the other tensors (parameters,
    optimizer state, and what a strategy gathered into new tensors) are copied by ``run``.
    """

    def __init__(self, ctx: Checkpointable, stager: Any) -> None:
        import torch

        self.stager = stager
        self.buffers = {_storage(b) for m in ctx.registry.models for b in m.buffers()} - {0}
        self.todo: list[tuple[Any, Any]] = []  # (Future, state dict with the tensors to copy)
        self.done = Copying()
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def __call__(self, state_dict: Any) -> Any:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        self.todo.append((future, _freeze(state_dict, self.buffers)))
        return future

    def start(self, barrier: CopyBarrier) -> None:
        """On the loop's thread, once every state dict was given: the copies will see what the
        loop's stream has done so far (on a GPU), and every optimizer's next step waits for them
        (``barrier``)."""
        import torch

        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        barrier.add(self.done)

    def run(self) -> None:
        """The copies (the writer thread's first work). A failure fails each future, so the jobs
        that wanted them fail the save; ``done`` is set either way."""
        import contextlib

        import torch

        try:
            if before_stage is not None:
                before_stage()
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                for future, state_dict in self.todo:
                    if _spent(self.stager):
                        self.stager = _new_stager()
                    future.set_result(self.stager.stage(state_dict))
        except BaseException as e:  # noqa: BLE001 - raised by the jobs that wanted the copies
            for future, _ in self.todo:
                if not future.done():
                    future.set_exception(e)
        finally:
            self.todo = []
            self.done.set()


def _storage(t: Any) -> int:
    """The address of the storage under ``t`` (a DTensor's local shard)."""
    return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()


def _freeze(obj: Any, copy_now: set[int]) -> Any:
    """``obj`` with its containers copied and its tensors whose storage is in ``copy_now`` cloned."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if _storage(obj) in copy_now else obj
    if isinstance(obj, dict):
        out = {k: _freeze(v, copy_now) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if isinstance(obj, list):
        return [_freeze(v, copy_now) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_freeze(v, copy_now) for v in obj)
    return obj


class PendingSave:
    """One asynchronous save: ``run`` in a thread that is not a daemon; ``wait`` joins it."""

    def __init__(self, target: str, run: Callable[[], None], copies: Staging, barrier: CopyBarrier) -> None:
        self.target = target
        self.error: BaseException | None = None
        self._run = run
        self.copies = copies  # made first, in the thread
        self.thread = threading.Thread(target=self._main, name="hasten-checkpoint-writer", daemon=False)
        _unreported.add(self)
        copies.done.target = target
        copies.start(barrier)
        try:
            self.thread.start()
        except BaseException:
            copies.done.set()  # no step may wait for a thread that never ran
            raise

    def _main(self) -> None:
        try:
            self.copies.run()
            self._run()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), which raises it
            self.error = e
        finally:
            self._run = None  # type: ignore[assignment] - frees the staged copies it held

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        """Until the thread ended; a ``TimeoutError`` after the run's timeout (the save goes on)."""
        from hasten.distributed.state import timeout_error
        from hasten.settings.groups import group_timeout

        timeout = group_timeout()
        self.thread.join(None if timeout is None else timeout.total_seconds())
        if self.thread.is_alive():
            raise timeout_error(f"the asynchronous save_state of {self.target!r}", timeout)

    def wait(self) -> None:
        """``join``, then raise the save's error (once)."""
        self.join()
        _unreported.discard(self)
        error, self.error = self.error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"the asynchronous save_state of {self.target!r} failed: {error}") from None
            raise CheckpointError(
                f"the asynchronous save_state of {self.target!r} failed: {first_line(error)}"
            ) from error


def _sharded_job(key: Any, tmp: str, item: Any, copy: Any, unsynced: list[str], group: Any) -> dict[str, str]:
    return write_sharded(key, tmp, item, copy.result(), unsynced, group)


def _file_job(tmp: str, item: Any, copy: Any, group: Any) -> dict[str, str]:
    return write_file(tmp, item, copy.result())


@dataclass
class Staged:
    """What the loop's thread left for the writer thread: the records of the files it wrote
    (``files``), the writes of the large ones from their host copies (``jobs``: ``job(group) ->
    {name: path}``), and the plan's manifest fields."""

    files: dict[str, dict[str, Any]]
    jobs: list[Callable[[Any], dict[str, str]]]
    manifest: ManifestFields | None


class BackgroundExecutor(Executor):
    """Runs a save in the background: the folder, the plan and its small files now, on every
    process together; the host copies, the large files, the agreement that every process wrote
    and the commit in a ``PendingSave`` thread. Keeps the save in flight (``pending``, at most one)
    and torch's ``DefaultStager`` (``stager``) from one save to the next: torch reuses its host
    buffers, so a later save copies into memory already mapped (about 4x faster than into new
    memory here) and pinning happens once. The copy costs the state's size in host memory from
    the first asynchronous save until ``close`` (``end_training``)."""

    def __init__(self, ctx: Checkpointable, plans_key: str, barrier: CopyBarrier) -> None:
        super().__init__(ctx, plans_key)
        self.barrier = barrier
        #: the asynchronous save_state still writing, if any
        self.pending: PendingSave | None = None
        #: torch's DefaultStager, kept between asynchronous saves (its host buffers reused)
        self.stager: Any = None

    def stage(self, plan: SavePlan, tmp: str, copies: Staging) -> Staged:
        """On the loop's thread: the small files written now; each large one (and each sharded
        folder) left as a job writing from its host copy (``copies``, made first in the thread)."""
        jobs: list[Callable[[Any], dict[str, str]]] = []
        written: dict[str, str] = {}
        unsynced: list[str] = []
        key = self.plans_key
        with files.recording() as recorded:
            # Each host copy starts now; its job writes it later.
            for item in plan.sharded:
                jobs.append(functools.partial(_sharded_job, key, tmp, item, copies(item.state_dict), unsynced))
            if plan.sharded:
                jobs.append(lambda group: sync_all(unsynced))
            for item in plan.files:
                if item.large:
                    jobs.append(functools.partial(_file_job, tmp, item, copies(item.obj)))
                else:
                    written.update(write_file(tmp, item, item.obj))
        return Staged(records(recorded, written), jobs, plan.manifest)

    def write_later(self, tmp: str, group: Any, staged: Staged) -> Written:
        """The jobs the staging left (the writer thread's part): this process's report."""
        out = dict(staged.files)
        with files.recording() as recorded:
            for job in staged.jobs:
                if before_write is not None:
                    before_write(tmp)
                out.update(records(recorded, job(group)))
        return Written(out, staged.manifest)

    def run(self, txn: Transaction, plan: Callable[[], SavePlan]) -> None:
        """The save of ``txn``: its folder and ``plan()`` staged now (agreed by every process),
        then a ``PendingSave`` thread copies, writes, agrees over ``group()`` and commits."""
        ctx = self.ctx
        grp = group()  # collective: before anything can fail on one process
        if self.stager is None:
            self.stager = _new_stager()
        copies = Staging(ctx, self.stager)
        try:
            begin(ctx, txn)
            staged = ctx.agree("save_state (staging)", txn.explained(lambda: self.stage(plan(), txn.tmp, copies)))
        except BaseException as e:
            txn.end(failed=True)
            same = agreed(e)
            if same is e:
                raise
            raise same from e

        def in_thread() -> None:
            try:
                replace_previous(ctx, txn, grp)  # at a URL: the previous copy goes once the plan is staged
                write = txn.explained(lambda: (txn.upload_hook_files(), self.write_later(txn.tmp, grp, staged))[1])
                reports = ctx.agree("save_state (writing in the background)", write, share=True, group=grp)
                ctx.agree(
                    "save_state (finalising in the background)", txn.explained(lambda: txn.commit(reports)), group=grp
                )
            except BaseException as e:
                txn.end(failed=True)
                same = agreed(e)  # every process raises the same type
                if same is e:
                    raise
                raise same from e
            txn.end(failed=False)

        try:
            self.pending = PendingSave(txn.target, in_thread, copies, self.barrier)
        except BaseException:
            txn.end(failed=True)
            raise

    def wait(self) -> None:
        """Finish the save in flight, if any; its error (the same on every process) is raised here,
        once. A ``TimeoutError`` after the run's timeout leaves it in flight (``pending``)."""
        pending = self.pending
        if pending is not None:
            try:
                pending.join()
                self.pending = None
                pending.wait()
            finally:
                self.barrier.prune()

    def close(self) -> None:
        """Free the stager's host buffers, unless a save (one that timed out) is still in flight:
        its thread may be copying into them."""
        if self.pending is None and self.stager is not None:
            self.stager.close()
            self.stager = None


def _report_at_exit() -> None:
    """At exit (after the interpreter joined the writer threads): say what failed unseen."""
    for pending in list(_unreported):
        if pending.done() and pending.error is not None:
            try:
                pending.wait()
            except CheckpointError as e:
                sys.stderr.write(f"hasten: {e}\n")
                sys.stderr.flush()


atexit.register(_report_at_exit)
