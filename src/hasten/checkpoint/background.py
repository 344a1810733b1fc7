"""Asynchronous ``save_state``: the loop waits for staging only; one thread per process writes.

``save_state(async_save=True)`` copies the state to host memory on the training loop's thread
(``stager``: torch's ``DefaultStager``, its buffers kept for the next save; pinned memory where
an accelerator exists) and returns.
A ``PendingSave`` thread then writes the files (``torch.distributed.checkpoint.save`` of each
staged state dict), agrees with every other process over a gloo group of its own that every
write finished, and the main process writes the manifest and renames the folder into place:
the same steps, in the same order, as a synchronous save, so a crash leaves what it leaves
(a hidden folder without a manifest). At most one save is in flight: ``wait`` finishes it and
raises its error; ``save_state``, ``load_state``, ``wait_for_checkpoint`` and ``end_training``
call it, and the thread is not a daemon, so the interpreter's exit waits for it too.

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
hashing writer (see ``io.dcp_writer``).

The background collectives run on a gloo group made for them (``group``), never the default
group: under NCCL async DCP needs a CPU-capable group (as torchtitan makes one), and on gloo
the training loop's own collectives on the default group would interleave with them.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, first_line

if TYPE_CHECKING:  # pragma: no cover
    from .context import Checkpointable

# For tests: called with the temporary folder's path before each background write (of a DCP
# folder or a file; a test makes it slow, or kills the process there). None in normal runs.
before_write: Callable[[str], None] | None = None

_group: list[Any] = [None, None]  # [the default group it was made for, the gloo group]
_unreported: set[PendingSave] = set()  # saves nobody waited for yet (reported at exit if they failed)


def group() -> Any:
    """The gloo group of every process for background checkpoint collectives (made on first use;
    a collective call, so every process calls it at the same point); None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _group[0] is not world:
        _group[:] = [world, dist.new_group(backend="gloo")]
    return _group[1]


def _new_stager() -> Any:
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    device = torch.accelerator.is_available()
    return DefaultStager(StagingOptions(
        use_pinned_memory=device and torch.cuda.is_available(),
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=device,
    ))


def stager(ctx: Checkpointable) -> Any:
    """torch's ``DefaultStager`` of this Accelerator (synchronous copies to host memory; pinned,
    non-blocking and synchronised where an accelerator exists). It is kept from one save to the
    next: torch reuses its host buffers, so a later save copies into memory already mapped (about
    4x faster than into new memory here) and pinning happens once. The copy costs the state's
    size in host memory from the first asynchronous save until ``release`` (``end_training``)."""
    if ctx.stager is None:
        ctx.stager = _new_stager()
    return ctx.stager


def release(ctx: Checkpointable) -> None:
    """Finish the save in flight (raising its error) and free the stager's host buffers."""
    try:
        wait(ctx)
    finally:
        if ctx.stager is not None:
            ctx.stager.close()
            ctx.stager = None
        forget_plans(ctx)


def forget_plans(ctx: Checkpointable) -> None:
    """Drop this Accelerator's save plans from torch's plan cache (class-wide: kept until then)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    prefix = f"{ctx.plans_key}:"
    for cache in (getattr(SavePlanner, n, None) for n in ("_cached_save_plan", "_cached_all_plans",
                  "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan")):  # fmt: skip
        if isinstance(cache, dict):
            for key in [k for k in cache if isinstance(k, str) and k.startswith(prefix)]:
                del cache[key]


class PendingSave:
    """One asynchronous save: ``run`` in a thread that is not a daemon; ``wait`` joins it."""

    def __init__(self, target: str, run: Callable[[], None]) -> None:
        self.target = target
        self.error: BaseException | None = None
        self._run = run
        self.thread = threading.Thread(target=self._main, name="hasten-checkpoint-writer", daemon=False)
        _unreported.add(self)
        self.thread.start()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), which raises it
            self.error = e
        finally:
            self._run = None  # type: ignore[assignment] - frees the staged copies it held

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()
        _unreported.discard(self)
        error, self.error = self.error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"the asynchronous save_state of {self.target!r} failed: {error}") from None
            raise CheckpointError(
                f"the asynchronous save_state of {self.target!r} failed: {first_line(error)}"
            ) from error


def start(ctx: Checkpointable, target: str, run: Callable[[], None]) -> None:
    ctx.pending = PendingSave(target, run)


def wait(ctx: Checkpointable) -> None:
    """Finish the save in flight, if any; its error (the same on every process) is raised here, once."""
    pending, ctx.pending = ctx.pending, None
    if pending is not None:
        pending.wait()


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
