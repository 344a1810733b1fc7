"""``save_state``/``load_state``: atomic, agreed across processes, in the layout of the strategy.

Writing is atomic: every process writes its files into a temporary directory next to the
target (``.NAME.tmp-TOKEN``), each file is fsynced; after all processes report, the main
process checks the files, writes the manifest, fsyncs and renames the directory into
place. A crash leaves the previous checkpoint intact and at most a hidden temporary
directory without a manifest, which ``load_state`` refuses. The directory must be on a
filesystem that every process sees (the main process checks that it sees every file).

``load_state`` first reads and checks everything on every process and only then restores
anything, so a bad checkpoint is an error before any object changed. Every step runs through
``Checkpointable.agree``: a failure on one process is an error on all of them, never a hang.

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
import shutil
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.hooks import RemovableHandle

from .. import _validate as v
from . import background, errors, io, naming
from .context import Checkpointable, CheckpointInfo
from .layouts import foreign_layout, get_layout
from .manifest import MANIFEST, build_manifest, read_manifest


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


# ---------------------------------------------------------------------- save_state

_NOTHING_REPLACED = "Nothing was replaced: the partial folder is removed and any earlier checkpoint is kept"


def _explained(fn: Callable[[], Any], what: str, then: str = "", dcp_only: bool = False) -> Callable[[], Any]:
    """``fn`` whose failure caused by the operating system (disk full, no permission) or inside
    torch.distributed.checkpoint (only that with ``dcp_only``) is raised as one ``CheckpointError``
    line saying so."""

    def run() -> Any:
        try:
            return fn()
        except BaseException as e:
            explained = errors.explain(e, what, then) if not dcp_only or errors.is_dcp_exception(e) else None
            if explained is None:
                raise
            raise explained from None

    return run


def claim_project_dir(ctx: Checkpointable) -> None:
    """With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, lock
    ``project_dir/checkpoints`` for this run now (at ``Accelerator(...)``), so that a second run on
    the same folder is refused before it loads or trains, not at its first ``save_state``. A folder
    that cannot be written (a read-only copy of a finished run) is not locked: its checkpoints can
    be loaded, and the first ``save_state`` there is refused, saying why."""
    config = ctx.project
    if not config.automatic_checkpoint_naming or config.project_dir is None:
        return
    root = naming.checkpoints_root(config.project_dir, "Accelerator")

    def claim() -> None:
        if ctx.state.is_main_process:
            naming.lock_folder(root, ctx, "Accelerator", read_only_ok=True)

    ctx.agree("Accelerator (claiming the checkpoint folder)", claim)


class _Hold:
    """What the main process holds for one save: its claim on an explicitly named folder (none with
    automatic naming, where the run holds the whole folder) and the temporary folder, once made."""

    def __init__(self) -> None:
        self.claimed: list[naming.Claim] = []
        self.tmp: str | None = None

    def end(self, failed: bool) -> None:
        """The save ended: remove its temporary folder if it failed, then let go of the folder."""
        if failed and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        while self.claimed:
            self.claimed.pop().release()


def _prepare_folder(ctx: Checkpointable, target: str, tmp: str, automatic: bool, hold: _Hold) -> None:
    """The main process's first step of a save: hold the folder (automatic naming: this run's lock
    on ``project_dir/checkpoints``, held while it lives; else this save's lock on ``target``, kept
    in ``hold`` until the save ended), so that no other run writes there meanwhile; then put back
    what a crash between two renames left hidden, remove what crashed saves left (never what a
    live save of another run is writing), check ``target`` and create ``tmp``. A refusal leaves
    the folder as it was."""
    parent, name = os.path.split(target)
    if automatic:
        naming.lock_folder(parent, ctx)
    else:
        claim = naming.claim(parent, name)
        if claim is not None:
            hold.claimed.append(claim)
    _recover(parent, None if automatic else name, "save_state")
    naming.remove_leftovers(parent, None if automatic else name)
    if os.path.islink(target):
        raise errors.CheckpointError(
            f"save_state: {name!r} in {parent!r} is a symbolic link; hasten does not follow links it did not "
            "create: remove it, or save to the folder it points to"
        )
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"save_state: {target!r} exists and is not a directory")
    if os.path.isdir(target) and os.listdir(target) and not os.path.exists(os.path.join(target, MANIFEST)):
        raise ValueError(
            f"save_state: {target!r} exists, is not empty and is not a hasten checkpoint; "
            "refusing to replace it (choose another directory)"
        )
    os.makedirs(parent, exist_ok=True)
    os.mkdir(tmp)
    hold.tmp = tmp


def _check_options(ctx: Checkpointable, total_limit: Any, safe_serialization: Any, async_save: Any) -> bool:
    """``save_state``'s options checked; whether the save is asynchronous."""
    if total_limit is not None:
        v.check_number("save_state", "total_limit", total_limit, integer=True, ge=1)
    v.check_bool("save_state", "safe_serialization", safe_serialization)
    v.check_optional_bool("save_state", "async_save", async_save)
    if safe_serialization:
        io.require_safetensors("save_state(safe_serialization=True)")
    ctx.check_single_node("save_state")
    return ctx.project.async_save if async_save is None else async_save


def _target(
    ctx: Checkpointable, output_dir: str | os.PathLike | None, total_limit: int | None
) -> tuple[str, int | None, int | None]:
    """Where ``save_state`` writes: ``(folder, N of an automatically named checkpoint_N or None,
    total_limit to apply or None)``."""
    config = ctx.project
    if output_dir is not None and config.automatic_checkpoint_naming:
        warnings.warn(
            f"save_state(output_dir={output_dir!r}) is ignored: ProjectConfiguration(automatic_checkpoint_naming=True) "
            "names the checkpoint project_dir/checkpoints/checkpoint_N",
            stacklevel=4,
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
    return io.check_path("save_state", "output_dir", output_dir), None, None


def _warn_mid_cycle(ctx: Checkpointable) -> None:
    gradient_state = ctx.gradient_state
    if gradient_state.micro_step:
        warnings.warn(
            f"save_state() in the middle of a gradient accumulation cycle (micro-step "
            f"{gradient_state.micro_step} of {gradient_state.num_steps}): the gradients "
            "accumulated so far are not saved; save after a step where accelerator.sync_gradients is True",
            stacklevel=4,
        )


_Reports = tuple[dict[str, Any], dict[str, Any]]  # one process's (files written, layout information)


def _write_later(tmp: str, group: Any, done: tuple[dict[str, Any], dict[str, Any], list[Any]]) -> _Reports:
    """The jobs the staging left (the background thread's part of an asynchronous save)."""
    files, info, jobs = done
    with io.recording() as records:
        for job in jobs:
            if background.before_write is not None:
                background.before_write(tmp)
            files.update({k: io.recorded(records, p) for k, p in job(group).items()})
    return files, info


def _finalise(layout_name: str, tmp: str, target: str, reports: list[_Reports], total_limit: int | None) -> None:
    """The main process's last step: check every process's files, write the manifest, rename
    ``tmp`` into place at ``target`` (the previous copy aside, then removed), rotate."""
    parent, name = os.path.split(target)
    files: dict[str, Any] = {}
    for records, _ in reports:
        files.update(records)
    for file_name, rec in files.items():
        path = os.path.join(tmp, file_name)
        if not os.path.isfile(path) or os.path.getsize(path) != rec["size"]:
            raise RuntimeError(
                f"save_state: the main process does not see {file_name!r} as written by its process; "
                f"the checkpoint directory must be on a filesystem shared by all processes ({parent!r})"
            )
    manifest = build_manifest(layout_name, **reports[0][1], files=dict(sorted(files.items())))
    io.write_json(os.path.join(tmp, MANIFEST), manifest)
    io.fsync_dir(tmp)
    if os.path.isdir(target):
        old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)  # the previous copy back at its name
            raise
        io.fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    io.fsync_dir(parent)
    if total_limit is not None:
        naming.rotate(parent, total_limit, protect=target)


def _start_background(
    ctx: Checkpointable, target: str, copies: Any, group: Any, hold: _Hold,
    write: Callable[[], Any], finish: Callable[[Any], None],
) -> None:  # fmt: skip
    """Start the background thread of an asynchronous save: ``write`` (what the staging left) on
    every process, then ``finish`` (the main process's manifest and rename); ``hold`` ends with it."""

    def run() -> None:
        try:
            reports = ctx.agree("save_state (writing in the background)", write, share=True, group=group)
            ctx.agree("save_state (finalising in the background)", lambda: finish(reports), group=group)
        except BaseException:
            hold.end(failed=True)
            raise
        hold.end(failed=False)

    try:
        background.start(ctx, target, run, copies)
    except BaseException:
        hold.end(failed=True)
        raise


def save_state(
    ctx: Checkpointable,
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
    naming that run's pid and host; nothing is written.

    ``async_save=True`` (else ``ProjectConfiguration.async_save``): return once the state dicts
    are taken (the models' buffers copied); a background thread copies the parameters and the
    optimizer state to host memory while the loop goes on (every prepared optimizer's next
    ``step`` waits for that copy), then writes the files, and the manifest and the rename come
    after every process's write finished, so the checkpoint appears whole or not at all.
    ``wait_for_checkpoint()`` waits for it and raises its error; the next ``save_state``,
    ``load_state`` and ``end_training`` (and the interpreter's exit) wait too.
    """
    main = ctx.state.is_main_process
    asynchronous = _check_options(ctx, total_limit, safe_serialization, async_save)
    layout = get_layout(ctx.strategy.checkpoint_layout)
    target, iteration, total_limit = _target(ctx, output_dir, total_limit)
    background.wait(ctx)  # at most one save in flight: the previous one finishes (or raises) first
    _warn_mid_cycle(ctx)
    parent, name = os.path.split(target)
    tmp = os.path.join(parent, f".{name}.tmp-{ctx.from_main(secrets.token_hex(6))}")
    hold = _Hold()  # the main process's, until the save ended (in the background thread, for an asynchronous one)
    group = background.group() if asynchronous else None  # collective: before anything can fail on one process
    copies = background.Staging(ctx, background.stager(ctx)) if asynchronous else None

    def make_tmp() -> None:
        if main:
            _prepare_folder(ctx, target, tmp, iteration is not None, hold)

    def write_files() -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        # Pre-hooks see the directory being written: what they put there is renamed into place with the rest.
        models = list(ctx.registry.models)
        weights = layout.weights(ctx, models)
        for hook in ctx.save_hooks.values():
            hook(models, weights, tmp)
        with io.recording() as records:
            written, info, jobs = layout.write(ctx, tmp, weights, safe=safe_serialization, stage=copies)
        return {k: io.recorded(records, p) for k, p in written.items()}, info, jobs

    def finalise(reports: list[_Reports]) -> None:
        if main:
            _finalise(layout.name, tmp, target, reports, total_limit)

    def explained(fn: Callable[[], Any]) -> Callable[[], Any]:
        return _explained(fn, f"save_state: cannot write the checkpoint {target!r}", _NOTHING_REPLACED)

    try:
        ctx.agree("save_state (creating the temporary directory)", explained(make_tmp))
        if copies is None:
            reports = ctx.agree("save_state (writing)", explained(lambda: write_files()[:2]), share=True)
            ctx.agree("save_state (finalising)", explained(lambda: finalise(reports)))
        else:
            staged = ctx.agree("save_state (staging)", explained(write_files))
    except BaseException:
        hold.end(failed=True)
        raise
    if copies is None:
        hold.end(failed=False)
    else:
        write = explained(lambda: _write_later(tmp, group, staged))
        _start_background(ctx, target, copies, group, hold, write, lambda reports: explained(lambda: finalise(reports))())
    ctx.project.iteration = ctx.project.iteration + 1 if iteration is None else iteration + 1
    return CheckpointInfo(target, iteration)


def wait_for_checkpoint(ctx: Checkpointable) -> None:
    """Wait until the asynchronous ``save_state`` in flight (if any) is written, its manifest
    written and its folder renamed into place; raise its error (a ``CheckpointError``, on every
    process) if it failed. Call it on every process."""
    background.wait(ctx)


def release_checkpoints(ctx: Checkpointable) -> None:
    """``wait_for_checkpoint``, then free the host copy asynchronous saves keep (``end_training``)."""
    background.release(ctx)


# ---------------------------------------------------------------------- load_state


def _recover(parent: str, name: str | None, call: str) -> list[tuple[str, str]]:
    """``naming.recover`` with a warning for each checkpoint put back."""
    recovered = naming.recover(parent, name)
    for found, entry in recovered:
        warnings.warn(
            f"{call}: {found!r} in {parent!r} was missing, a save having been interrupted between its two "
            f"renames; put back the complete copy {entry!r}",
            stacklevel=4,
        )
    return recovered


def _recover_input_dir(directory: str) -> None:
    """``load_state(input_dir)`` of a folder that a crash left hidden: put it back, or say why not."""
    if os.path.lexists(directory):
        return
    parent, name = os.path.split(directory)
    if _recover(parent, name, "load_state"):
        return
    hidden = [entry for _, kind, entry in naming.leftovers(parent, name) if kind in ("tmp", "old")]
    if hidden:
        raise FileNotFoundError(
            f"load_state: no checkpoint directory at {directory!r}; what an interrupted save of it left "
            f"({', '.join(map(repr, hidden))}) is incomplete (no {MANIFEST} or missing files), nothing was loaded"
        )


def _newest_told(root: str) -> str | None:
    """``newest_loadable`` after recovering interrupted re-saves, with one warning naming what
    newer than it was passed over (partial saves) and why."""
    _recover(root, None, "load_state")
    found = newest_loadable(root)
    newest = -1 if found is None else naming.iteration_of(found)
    skipped = [
        f"{name!r} (no {MANIFEST})"
        for n, name in naming.checkpoints(root)
        if n > newest and not os.path.isfile(os.path.join(root, name, MANIFEST))
    ]
    skipped += [
        f"{entry!r} (a save of {name!r} that did not finish)"
        for name, kind, entry in naming.leftovers(root)
        if kind == "tmp" and (naming.iteration_of(name) if naming.iteration_of(name) is not None else -1) > newest
    ]
    if skipped:
        warnings.warn(
            f"load_state: passed over {', '.join(skipped)} in {root!r}: incomplete; "
            + (f"loading {found!r}, the newest complete checkpoint" if found else "no complete checkpoint is left"),
            stacklevel=4,
        )
    return found


def newest_loadable(root: str) -> str | None:
    """The name of the newest ``checkpoint_N`` in ``root`` that ``load_state`` can read: one with
    a hasten manifest, or one a foreign layout (Accelerate's) recognises; half-written or
    unrelated folders are passed over."""
    for _, name in reversed(naming.checkpoints(root)):
        path = os.path.join(root, name)
        if os.path.isfile(os.path.join(path, MANIFEST)) or foreign_layout(path) is not None:
            return name
    return None


def load_state(
    ctx: Checkpointable,
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
    """
    ctx.check_single_node("load_state")
    v.check_bool("load_state", "weights_only", weights_only)
    v.check_bool("load_state", "verify_checksums", verify_checksums)
    v.check_bool("load_state", "strict_world_size", strict_world_size)
    v.check_bool("load_state", "missing_ok", missing_ok)
    if missing_ok and input_dir is not None:
        raise ValueError(
            f"load_state(missing_ok=True) looks for the newest checkpoint of project_dir (input_dir=None), "
            f"got input_dir={str(input_dir)!r}"
        )
    background.wait(ctx)  # an asynchronous save still in flight finishes (or raises) first
    if input_dir is None:
        root = naming.checkpoints_root(ctx.project.project_dir, "load_state")
        found = ctx.from_main(_newest_told(root) if ctx.state.is_main_process else None)
        if found is None:
            if missing_ok:
                return None
            raise FileNotFoundError(f"load_state: no complete checkpoint_N directory in {root!r}")
        directory = os.path.join(root, found)
    else:
        directory = io.check_path("load_state", "input_dir", input_dir)
        main = ctx.state.is_main_process
        ctx.agree("load_state (finding the folder)", lambda: _recover_input_dir(directory) if main else None)

    models = list(ctx.registry.models)
    chosen: list[Any] = []

    def read() -> Any:
        for hook in ctx.load_hooks.values():
            hook(models, directory)
        manifest = None
        layout = None if os.path.exists(os.path.join(directory, MANIFEST)) else foreign_layout(directory)
        if layout is None:
            manifest = read_manifest(directory)
            layout = get_layout(manifest["layout"])
        chosen.append(layout)
        return layout.read(ctx, directory, manifest, models, weights_only, verify_checksums, strict_world_size)

    # torch.distributed.checkpoint's CheckpointException is a BaseException: one CheckpointError instead
    cannot_read = f"load_state: cannot read the checkpoint {directory!r}"
    data = ctx.agree("load_state (reading)", _explained(read, cannot_read, "Nothing was restored", dcp_only=True))
    ctx.agree("load_state (restoring)", lambda: chosen[0].restore(ctx, data, directory, models))
    if isinstance(data, dict) and data.get("warning"):
        warnings.warn(data["warning"], stacklevel=3)
    return CheckpointInfo(directory, naming.iteration_of(directory))
