"""The ``Checkpointer``: an Accelerator's ``save_state``/``load_state``, in one object it holds.

A save, in order: the options checked, the target named (``project_dir/checkpoints/checkpoint_N``
or ``output_dir``), the save in flight finished, then one of two executors runs it: the folder
is made (``commit.Transaction.begin``), the save pre-hooks run and the layout plans
(``Layout.plan_save``: a ``plans.SavePlan``), the executor writes the plan, and the main process
commits (manifest, rename, rotation). ``Executor`` writes now; ``BackgroundExecutor`` writes
the large files from a host copy in a thread, and every prepared optimizer's next step waits
for that copy (``barrier``). The executor is chosen per save (``async_save``, else
``ProjectConfiguration.async_save``); nothing after that choice asks again.

``load_state`` first reads and checks everything on every process (``Layout.read``: a
``plans.Restore``) and only then restores anything (``Layout.restore``), so a bad checkpoint is
an error before any object changed. Every step runs through ``Checkpointable.agree``: a failure
on one process is an error on all of them, never a hang.

Pre-hooks (``register_save_state_pre_hook``/``register_load_state_pre_hook``) run on every
process: ``hook(models, weights, output_dir)`` before anything is written, with the
temporary directory (what a hook writes there lands in the checkpoint atomically) and the
full state dicts, of which only those left in ``weights`` are saved; ``hook(models,
input_dir)`` before anything is read, and only the models left in ``models`` are restored
from the checkpoint's weights (a hook that loads a model itself removes it).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from hasten import _validate as v
from hasten.checkpoint import errors, locks, naming, replica_groups, storage
from hasten.checkpoint.background import BackgroundExecutor
from hasten.checkpoint.commit import Transaction, newest_told, recover_input_dir
from hasten.checkpoint.context import Checkpointable, CheckpointInfo
from hasten.checkpoint.executor import Executor, forget_plans
from hasten.checkpoint.layouts import foreign_layout, get_layout
from hasten.checkpoint.manifest import MANIFEST, read_manifest
from hasten.checkpoint.plans import LoadOptions, Restore, SavePlan

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.barrier import CopyBarrier
    from hasten.checkpoint.layouts import Layout


class Checkpointer:
    """An Accelerator's checkpoints: its parts (``ctx``), the barrier its optimizers wait on
    (``barrier``), and the two executors (``now``, ``background``: the save in flight, the host
    copy kept between saves)."""

    def __init__(self, ctx: Checkpointable, barrier: CopyBarrier) -> None:
        self.ctx = ctx
        self.barrier = barrier
        #: this Accelerator's prefix of the keys of torch's save-plan cache (class-wide dicts): never
        #: the id() of an object, which a later Accelerator can get again and so find plans not its own
        self.plans_key = f"hasten:{secrets.token_hex(8)}"
        self.now = Executor(ctx, self.plans_key)
        self.background = BackgroundExecutor(ctx, self.plans_key, barrier)

    def claim_project_dir(self) -> None:
        """With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, lock
        ``project_dir/checkpoints`` for this run now (at ``Accelerator(...)``), so that a second run on
        the same folder is refused before it loads or trains, not at its first ``save_state``. A folder
        that cannot be written (a read-only copy of a finished run) is not locked: its checkpoints can
        be loaded, and the first ``save_state`` there is refused, saying why."""
        ctx = self.ctx
        config = ctx.project
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            return
        root = naming.checkpoints_root(config.project_dir, "Accelerator")

        def claim() -> None:
            if ctx.state.is_main_process:
                locks.lock_folder(root, ctx, "Accelerator", read_only_ok=True)

        ctx.agree("Accelerator (claiming the checkpoint folder)", claim)

    # ------------------------------------------------------------------ save_state
    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        *,
        total_limit: int | None = None,
        safe_serialization: bool = True,
        async_save: bool | None = None,
    ) -> CheckpointInfo:
        """Save everything needed to resume training exactly; returns where.

        Without ``output_dir`` (or always, with ``ProjectConfiguration(automatic_checkpoint_naming=True)``)
        the checkpoint is ``project_dir/checkpoints/checkpoint_N`` with N the larger of one more than the
        largest existing and ``ProjectConfiguration.iteration``; ``total_limit`` (else the
        configuration's) then keeps only the newest N checkpoints there (the one just written is never
        deleted). ``iteration`` counts up after each save. Call it on every process.

        One writer per folder: a save into a folder that another run is writing (its checkpoints
        folder, or a save of the same ``output_dir`` in progress) is refused with a ``CheckpointError``
        naming that run's pid and host; nothing is written (on the local disk: at a URL nothing is
        locked, see ``locks.DISK_ONLY``).

        ``output_dir`` (and ``project_dir``) may be a URL of any installed fsspec protocol
        (``s3://bucket/run/ck``, ``gs://``, ``az://``, ``memory://``): every process writes its
        files there directly and the main process writes the manifest last, so a folder is a
        checkpoint once it has its manifest and is never loaded before (``commit``). A protocol
        whose package is missing is refused here, naming it, before anything is written.

        ``async_save=True`` (else ``ProjectConfiguration.async_save``): return once the state dicts
        are taken (the models' buffers copied); a background thread copies the parameters and the
        optimizer state to host memory while the loop goes on (every prepared optimizer's next
        ``step`` waits for that copy), then writes the files, and the manifest and the rename come
        after every process's write finished, so the checkpoint appears whole or not at all.
        ``wait_for_checkpoint()`` waits for it and raises its error; the next ``save_state``,
        ``load_state`` and ``end_training`` (and the interpreter's exit) wait too.

        No password written in a URL appears in what it raises (``errors.secrets_hidden``).
        """
        with errors.secrets_hidden(output_dir, self.ctx.project.project_dir, self._in_flight()):
            return self._save_state(output_dir, total_limit, safe_serialization, async_save)

    def _in_flight(self) -> str | None:
        """The folder of the asynchronous save in flight, if any."""
        pending = self.background.pending
        return None if pending is None else pending.target

    def _save_state(
        self, output_dir: str | os.PathLike | None, total_limit: Any, safe_serialization: Any, async_save: Any
    ) -> CheckpointInfo:
        """``save_state``, its secrets not yet hidden."""
        ctx = self.ctx
        asynchronous = self._check_options(total_limit, safe_serialization, async_save)
        layout = get_layout(ctx.strategy.checkpoint_layout)
        target, iteration, total_limit = self._target(output_dir, total_limit)
        self.background.wait()  # at most one save in flight: the previous one finishes (or raises) first
        _warn_mid_cycle(ctx)
        own = iteration is None and own_folders(ctx, target, asynchronous)
        tmp = _writing_folder(target, ctx.from_main(secrets.token_hex(6)))
        txn = Transaction(ctx, layout.name, target, tmp, iteration is not None, total_limit, own_folders=own)

        def plan() -> SavePlan:
            # Pre-hooks see the directory being written (at a URL a local one, uploaded once the previous copy is
            # gone: ``Transaction.hook_folder``): what they put there lands in the checkpoint with the rest.
            models = list(ctx.registry.models)
            weights = layout.weights(ctx, models)
            for hook in ctx.save_hooks.values():
                hook(models, weights, txn.hook_folder())
            return layout.plan_save(ctx, weights, safe_serialization)

        def write() -> None:
            (self.background if asynchronous else self.now).run(txn, plan)

        if ctx.fault_tolerance is None:
            write()
        else:  # replica groups of torchft: one writes the folder, with every group's positions
            replica_groups.save_once(ctx, target, asynchronous, write)
        ctx.project.iteration = ctx.project.iteration + 1 if iteration is None else iteration + 1
        return CheckpointInfo(target, iteration)

    def _check_options(self, total_limit: Any, safe_serialization: Any, async_save: Any) -> bool:
        """``save_state``'s options checked; whether the save is asynchronous."""
        if total_limit is not None:
            v.check_number("save_state", "total_limit", total_limit, integer=True, ge=1)
        v.check_bool("save_state", "safe_serialization", safe_serialization)
        v.check_optional_bool("save_state", "async_save", async_save)
        if safe_serialization:
            from hasten.checkpoint.weights import require_safetensors

            require_safetensors("save_state(safe_serialization=True)")
        self.ctx.check_single_node("save_state")
        return self.ctx.project.async_save if async_save is None else async_save

    def _target(
        self, output_dir: str | os.PathLike | None, total_limit: int | None
    ) -> tuple[str, int | None, int | None]:
        """Where ``save_state`` writes: ``(folder, N of an automatically named checkpoint_N or None,
        total_limit to apply or None)``."""
        ctx = self.ctx
        config = ctx.project
        if output_dir is not None and config.automatic_checkpoint_naming:
            errors.warn_user(
                f"save_state(output_dir={errors.redact(str(output_dir))!r}) is ignored: "
                "ProjectConfiguration(automatic_checkpoint_naming=True) "
                "names the checkpoint project_dir/checkpoints/checkpoint_N"
            )
            output_dir = None
        if output_dir is None:
            root = naming.checkpoints_root(config.project_dir, "save_state")
            next_free = (naming.iterations(root)[-1:] or [-1])[0] + 1 if ctx.state.is_main_process else None
            iteration = max(config.iteration, ctx.from_main(next_free))
            limit = total_limit if total_limit is not None else config.total_limit
            return os.path.join(root, f"checkpoint_{iteration}"), iteration, limit
        if total_limit is not None:
            raise ValueError(
                "save_state.total_limit applies to automatically named checkpoints (output_dir=None), "
                f"got total_limit={total_limit} with output_dir={output_dir!r}"
            )
        return storage.check_location("save_state", "output_dir", output_dir, write=True), None, None

    def wait(self) -> None:
        """Wait until the asynchronous ``save_state`` in flight (if any) is written, its manifest
        written and its folder renamed into place; raise its error (a ``CheckpointError``, on every
        process) if it failed. Call it on every process."""
        with errors.secrets_hidden(self._in_flight()):
            self.background.wait()

    def release(self) -> None:
        """``wait``, then free the host copy asynchronous saves keep and this Accelerator's save
        plans in torch's cache (``end_training``); both are kept while a save that timed out is in flight."""
        try:
            self.wait()
        finally:
            if self.background.pending is None:
                self.background.close()
                forget_plans(self.plans_key)

    # ------------------------------------------------------------------ load_state
    def load_state(
        self,
        input_dir: str | os.PathLike | None = None,
        *,
        weights_only: bool = True,
        verify_checksums: bool = True,
        strict_world_size: bool = False,
        missing_ok: bool = False,
    ) -> CheckpointInfo | None:
        """Restore what ``save_state`` saved; returns where from. Call it on every process.

        Without ``input_dir`` the newest complete ``project_dir/checkpoints/checkpoint_N`` is loaded;
        when there is none, FileNotFoundError, or with ``missing_ok=True`` None (nothing changed:
        the resume-or-start pattern of an elastic run that may restart).
        Every file is read and checked on every process before any object is changed.

        A checkpoint saved by another number of processes loads too (``strict_world_size=True``
        refuses it): the models, optimizers (resharded, for a sharded "dcp" checkpoint; whole for a
        "full" one), schedulers, scaler, registered objects and loop counters as at the same size;
        every dataloader continues its epoch from the saved global position (samples consumed by
        all processes), so each sample of the epoch is seen once; processes the saving run had get
        their RNG states back, new ones seed from the saved seed + their rank. When the global batch
        size changes, the main process warns once with the old and new sizes.

        Nothing read from a checkpoint runs (``checkpoint.unpickle``): torch files and DCP's
        non-tensor items are read with ``torch.load(weights_only=True)``, DCP's ``.metadata``
        through an allow-list of its own classes; a file asking for anything else is refused
        (``UnsafeCheckpoint``, naming the file and what it asked for) with nothing restored.
        ``weights_only=False`` is for a trusted checkpoint holding other objects (registered
        objects of your own classes): it runs what those files name, except in ``.metadata``,
        which is always allow-listed. The manifest's checksums detect damage, not a forger.
        No password written in a URL appears in what it raises (``errors.secrets_hidden``).
        """
        with errors.secrets_hidden(input_dir, self.ctx.project.project_dir, self._in_flight()):
            return self._load_state(input_dir, weights_only, verify_checksums, strict_world_size, missing_ok)

    def _load_state(
        self,
        input_dir: str | os.PathLike | None,
        weights_only: Any,
        verify_checksums: Any,
        strict_world_size: Any,
        missing_ok: Any,
    ) -> CheckpointInfo | None:
        """``load_state``, its secrets not yet hidden."""
        ctx = self.ctx
        ctx.check_single_node("load_state")
        options = LoadOptions(
            v.check_bool("load_state", "weights_only", weights_only),
            v.check_bool("load_state", "verify_checksums", verify_checksums),
            v.check_bool("load_state", "strict_world_size", strict_world_size),
        )
        v.check_bool("load_state", "missing_ok", missing_ok)
        if missing_ok and input_dir is not None:
            raise ValueError(
                f"load_state(missing_ok=True) looks for the newest checkpoint of project_dir (input_dir=None), "
                f"got input_dir={str(input_dir)!r}"
            )
        self.background.wait()  # an asynchronous save still in flight finishes (or raises) first
        directory = self._find(input_dir, missing_ok)
        if directory is None:
            return None
        models = list(ctx.registry.models)
        chosen: list[Layout] = []

        def read() -> Restore:
            for hook in ctx.load_hooks.values():
                hook(models, directory)
            # Nothing writes the folder while it is read: at a URL it is listed once, and each small
            # file downloaded once, verified and read from the same bytes (``storage.remembering``).
            with storage.remembering():
                manifest = None
                url = storage.is_url(directory)  # a URL is never a foreign layout: no probe for its manifest
                has_manifest = url or storage.exists(os.path.join(directory, MANIFEST))
                layout = None if has_manifest else foreign_layout(directory)
                if layout is None:
                    manifest = read_manifest(directory)
                    layout = get_layout(manifest["layout"])
                chosen.append(layout)
                return layout.read(ctx, directory, manifest, models, options)

        # torch.distributed.checkpoint's CheckpointException is a BaseException: one CheckpointError instead
        cannot_read = f"load_state: cannot read the checkpoint {directory!r}"
        r = ctx.agree(
            "load_state (reading)", errors.explained(read, cannot_read, "Nothing was restored", dcp_only=True)
        )
        ctx.agree("load_state (restoring)", lambda: chosen[0].restore(ctx, r, directory, models))
        if r.warning:
            errors.warn_user(r.warning)
        return CheckpointInfo(directory, naming.iteration_of(directory))

    def _find(self, input_dir: str | os.PathLike | None, missing_ok: bool) -> str | None:
        """The folder ``load_state`` reads: ``input_dir`` (put back if a crash left it hidden), else
        the newest complete checkpoint of ``project_dir`` (None with ``missing_ok`` where there is none)."""
        ctx = self.ctx
        main = ctx.state.is_main_process
        if input_dir is None:
            root = naming.checkpoints_root(ctx.project.project_dir, "load_state")
            found = ctx.from_main(newest_told(root) if main else None)
            if found is None:
                if missing_ok:
                    return None
                raise FileNotFoundError(
                    f"load_state: no complete checkpoint_N directory in {errors.redact(root)!r}; a run that may "
                    "start without one (resume or start) calls load_state(missing_ok=True), which returns None"
                )
            return storage.of(root).join(root, found)
        directory = storage.check_location("load_state", "input_dir", input_dir)
        ctx.agree("load_state (finding the folder)", lambda: recover_input_dir(directory) if main else None)
        return directory


def own_folders(ctx: Checkpointable, target: str, asynchronous: bool) -> bool:
    """Whether every process saves into a folder of its own: the processes were given different
    ``output_dir``s, which is Ray Train's pattern (each worker saves into its own
    ``tempfile.TemporaryDirectory()`` and reports it with ``ray.train.report``; Ray gathers the
    workers' files into one checkpoint). Each process then writes its part into its folder and
    the main process's gets the manifest of every file. Outside Ray Train, or with two processes
    sharing one of several folders, a URL among them or ``async_save``, different folders are
    refused on every process, naming each process's. One collective (save_state's ``output_dir``)."""
    if not ctx.state.use_distributed:
        return False
    from hasten.distributed.ops import gather_object

    told = gather_object((target, _in_ray_train()))
    folders = [folder for folder, _ in told]
    if len(set(folders)) == 1:
        return False
    listed = "; ".join(f"process {rank}: {folder!r}" for rank, folder in enumerate(folders))
    why = None
    if not all(ray for _, ray in told):
        why = "outside Ray Train every process must be given the same output_dir, a folder all of them see"
    elif len(set(folders)) != len(folders):
        why = "some processes share a folder and others do not: give each its own, or all the same one"
    elif _nested(folders):
        why = (
            "{} lies inside {}: a save into the outer folder would delete the inner one's part; give each "
            "process a folder of its own outside the others'".format(*map(repr, _nested(folders)))
        )
    elif any(storage.is_url(folder) for folder in folders):
        why = "a folder per process must be on each process's local disk (Ray uploads it); a URL is one folder"
    elif asynchronous:
        why = "async_save=True cannot write into folders Ray takes as soon as save_state returns: save synchronously"
    if why is not None:
        raise ValueError(f"save_state: the processes were given different folders ({listed}): {why}")
    return True


def _nested(folders: list[str]) -> tuple[str, str] | None:
    """``(inner, outer)`` of the first two of ``folders`` where one lies inside the other (real paths), else None."""
    real = [os.path.realpath(f) if not storage.is_url(f) else f for f in folders]
    for i, inner in enumerate(real):
        for j, outer in enumerate(real):
            if i != j and inner.startswith(outer.rstrip(os.sep) + os.sep):
                return folders[i], folders[j]
    return None


def _in_ray_train() -> bool:
    """Whether this process is a worker of a Ray Train run (Ray already imported by it: no import here)."""
    import sys

    train = sys.modules.get("ray.train")
    if train is None:
        return False
    try:
        train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001 - no Ray Train session here
        return False
    return True


def _writing_folder(target: str, token: str) -> str:
    """Where a save of ``target`` writes: a hidden folder beside it on the local disk (renamed into
    place at the commit), ``target`` itself at a URL (an object store has no rename: the manifest,
    written last, makes it a checkpoint)."""
    if storage.is_url(target):
        return target
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.tmp-{token}")


def _warn_mid_cycle(ctx: Checkpointable) -> None:
    gradient_state = ctx.gradient_state
    if gradient_state.micro_step:
        errors.warn_user(
            f"save_state() in the middle of a gradient accumulation cycle (micro-step "
            f"{gradient_state.micro_step} of {gradient_state.num_steps}): the gradients "
            "accumulated so far are not saved; save after a step where accelerator.sync_gradients is True"
        )


# ---------------------------------------------------------------------- public functions of the package


def check_registrable(objects: Iterable[Any]) -> list[Any]:
    """The objects, if each has ``state_dict`` and ``load_state_dict`` methods; else ValueError (as Accelerate)."""
    objects = list(objects)
    bad = [
        f"Item at index {i} ({type(o).__name__})"
        for i, o in enumerate(objects)
        if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))
    ]
    if bad:
        raise ValueError(
            f"register_for_checkpointing() takes objects with state_dict() and load_state_dict() methods; "
            f"these have not: {'; '.join(bad)}"
        )
    return objects


def register_hook(hooks: dict[int, Callable[..., None]], hook: Any, call: str) -> RemovableHandle:
    """Add ``hook`` to ``hooks`` (run in insertion order); ``handle.remove()`` takes it out."""
    v.check_callable(call, "hook", hook, optional=False)
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def claim_project_dir(checkpointer: Checkpointer) -> None:
    """``checkpointer.claim_project_dir()``."""
    checkpointer.claim_project_dir()


def save_state(
    checkpointer: Checkpointer, output_dir: str | os.PathLike | None = None, **options: Any
) -> CheckpointInfo:
    """``checkpointer.save_state(output_dir, **options)``."""
    return checkpointer.save_state(output_dir, **options)


def load_state(
    checkpointer: Checkpointer, input_dir: str | os.PathLike | None = None, **options: Any
) -> CheckpointInfo | None:
    """``checkpointer.load_state(input_dir, **options)``."""
    return checkpointer.load_state(input_dir, **options)


def wait_for_checkpoint(checkpointer: Checkpointer) -> None:
    """``checkpointer.wait()``: the asynchronous save in flight written, or its error raised."""
    checkpointer.wait()


def release_checkpoints(checkpointer: Checkpointer) -> None:
    """``checkpointer.release()``: ``wait_for_checkpoint``, then the host copy freed (``end_training``)."""
    checkpointer.release()
