"""The commit step of a save, and the recovery of what interrupted saves left.

Writing is atomic: every process writes its files into a temporary directory next to the
target (``.NAME.tmp-TOKEN``), each file is fsynced; after all processes report, the main
process checks the files, writes the manifest, fsyncs and renames the directory into
place. A crash leaves the previous checkpoint intact and at most a hidden temporary
directory without a manifest, which ``load_state`` refuses. The directory must be on a
filesystem that every process sees (the main process checks that it sees every file).

``Transaction`` is one save's folder, on the main process: ``begin`` holds the folder (one
writer per folder), puts back what a crash between two renames left hidden, removes what crashed
saves left and creates the temporary folder; ``commit`` writes the manifest, renames and rotates
(``total_limit``); ``end`` removes the temporary folder of a failed save and lets go of the folder.
The same for every layout and for both executors (an asynchronous save commits in its writer
thread). ``newest_told``, ``recover_input_dir``: a load's side of the same leftovers.

At a URL (an object store: no rename, no fsync, no lock) the same steps write straight into the
target folder: ``begin`` removes what interrupted saves left (``naming.clean_marked``) and marks
the folder (``naming.mark``); only once the plan is built (pre-hooks, state dicts: all that can
fail before a byte is written) does ``replace`` delete a previous copy (its manifest, then the
files it lists), right before every process writes its files; ``commit`` checks them in one
listing, writes the manifest last and deletes the mark. A folder without its manifest is never
loaded; the next save removes it. So a re-save at a URL loses the previous copy only when it
fails after ``replace`` (an interrupted upload: docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hasten.checkpoint import errors, files, locks, naming, storage
from hasten.checkpoint.layouts import foreign_layout
from hasten.checkpoint.manifest import MANIFEST, build_manifest
from hasten.settings.locations import redact

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import Written

_NOTHING_REPLACED = "Nothing was replaced: the partial folder is removed and any earlier checkpoint is kept"
_REPLACED = (
    "The previous copy in that folder had been deleted before the upload began (an object store has no "
    "rename: docs/checkpoints.md, 'A re-save at a URL'); what was uploaded is removed (by the next save, "
    "where the store cannot be reached now)"
)


class Transaction:
    """One save of ``layout`` into ``target`` through the temporary folder ``tmp``; ``automatic``:
    an automatically named ``checkpoint_N`` (the run holds the whole folder), else this save claims
    ``target`` until it ended. ``total_limit``: the rotation to apply once committed (or None)."""

    def __init__(
        self,
        ctx: Checkpointable,
        layout: str,
        target: str,
        tmp: str,
        automatic: bool,
        total_limit: int | None,
        own_folders: bool = False,
    ) -> None:
        self.ctx, self.layout, self.target, self.tmp = ctx, layout, target, tmp
        self.automatic, self.total_limit = automatic, total_limit
        #: every process saves into a folder of its own (Ray Train's pattern, ``checkpointer.own_folders``):
        #: each holds, checks and renames its own; the main process's gets the manifest of every file
        self.own_folders = own_folders
        self.claimed: list[locks.Claim] = []
        self.made: str | None = None  # the temporary folder, once the main process made it
        self.store = storage.of(target)  # chosen once: the local disk, or an fsspec URL
        self.marker: str | None = None  # at a URL: the mark beside the folder while it is written
        #: at a URL, on the main process: whether the folder holds a previous copy (a re-save), which ``replace``
        #: deletes; ``replaced``: on every process, whether it did (the previous copy is gone)
        self.previous = False
        self.replaced = False
        #: on every process: whether ``begin`` may have found a previous copy (``executor.begin`` tells them)
        self.previous_anywhere = True
        self.found: list[str] = []  # at a URL: the previous copy's objects but its manifest (``begin``'s listing)
        #: where the pre-hooks write (``hook_folder``): ``tmp`` on the disk; at a URL a local folder of this
        #: process's, uploaded into the checkpoint once the previous copy is gone (``upload_hook_files``)
        self.staging: str | None = None

    def explained(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` whose OS or DCP failure (at a URL: whatever the storage library raised) is one
        ``CheckpointError`` naming the target and what became of the previous copy."""

        def run() -> Any:
            try:
                return fn()
            except BaseException as e:
                what = f"save_state: cannot write the checkpoint {self.target!r}"
                then = _REPLACED if self.replaced else _NOTHING_REPLACED
                found = errors.storage_failure(e, what, then) if self.store.url else errors.explain(e, what, then)
                if found is None:
                    raise
                raise found from (errors.original(e) if self.store.url else None)

        return run

    def begin(self) -> bool:
        """The main process's first step (others: nothing): hold the folder (automatic naming: this
        run's lock on ``project_dir/checkpoints``, held while it lives; else this save's lock on
        ``target``, kept until ``end``), so that no other run writes there meanwhile; then put back
        what a crash between two renames left hidden, remove what crashed saves left (never what a
        live save of another run is writing), check ``target`` and create ``tmp``. A refusal leaves
        the folder as it was. Whether there is a previous copy for ``replace`` to delete (at a URL)."""
        if not (self.ctx.state.is_main_process or self.own_folders):
            return False
        if self.store.url:
            self._begin_at_url()
            return self.previous
        parent, name = os.path.split(self.target)
        if self.automatic:
            locks.lock_folder(parent, self.ctx)
        else:
            claim = locks.claim(parent, name)
            if claim is not None:
                self.claimed.append(claim)
        recover(parent, None if self.automatic else name, "save_state")
        naming.remove_leftovers(parent, None if self.automatic else name)
        _check_target(self.target)
        os.makedirs(parent, exist_ok=True)
        os.mkdir(self.tmp)
        self.made = self.tmp
        return False

    def commit(self, reports: list[Written]) -> None:
        """The main process's last step (others: nothing): check every process's files, write the
        manifest, rename ``tmp`` into place at ``target`` (the previous copy aside, then removed), rotate."""
        main = self.ctx.state.is_main_process
        if not (main or self.own_folders):
            return
        if self.store.url:
            self._commit_at_url(reports)
            return
        parent, name = os.path.split(self.target)
        tmp, target = self.tmp, self.target
        written: dict[str, Any] = {}
        for report in reports:
            written.update(report.files)
        # each process sees its own folder only, where every process has one
        mine = reports[self.ctx.state.process_index].files if self.own_folders else written
        for file_name, rec in mine.items():
            path = os.path.join(tmp, file_name)
            if not os.path.isfile(path) or os.path.getsize(path) != rec["size"]:
                raise RuntimeError(
                    f"save_state: the main process does not see {file_name!r} as written by its process; "
                    f"the checkpoint directory must be on a filesystem shared by all processes ({parent!r})"
                )
        if main:  # the manifest (of every process's files) in the main process's folder
            fields = reports[0].manifest
            assert fields is not None  # the main process's report
            manifest = build_manifest(self.layout, **fields.as_dict(), files=dict(sorted(written.items())))
            files.write_json(os.path.join(tmp, MANIFEST), manifest)
        files.fsync_dir(tmp)
        _rename_into_place(tmp, target)
        if self.total_limit is not None:
            naming.rotate(parent, self.total_limit, protect=target)

    def end(self, failed: bool) -> None:
        """The save ended: remove its temporary folder if it failed, then let go of the folder
        (at a URL: the partial folder and its mark; the mark stays where the folder could not be
        removed, for the next save to)."""
        # A cleanup's own failure (the store gone) never masks the save's error: what stays is the next save's.
        if failed and self.made is not None:
            made, self.made = self.made, None
            try:
                self.store.rmtree(made)
            except Exception:  # noqa: BLE001 - whatever the storage library raises
                self.marker = None  # the mark stays: the next save removes the folder
        if self.marker is not None:
            marker, self.marker = self.marker, None
            with contextlib.suppress(Exception):  # else left for the next save (which removes it)
                self.store.remove(marker)
        while self.claimed:
            self.claimed.pop().release()
        if self.staging is not None:
            staging, self.staging = self.staging, None
            shutil.rmtree(staging, ignore_errors=True)

    # ------------------------------------------------------------------ at a URL
    def _begin_at_url(self) -> None:
        """``begin`` at a URL: no lock (``locks.DISK_ONLY``); what interrupted saves left removed,
        the target checked and marked. A previous copy stays until ``replace``."""
        st, target = self.store, self.target
        parent, name = target.rsplit("/", 1)
        # two listings at once: the marks beside the folder, and the folder (is there a previous copy, and
        # what ``replace`` deletes), listed again only where a mark said it was a partial folder, now removed
        with ThreadPoolExecutor(1, thread_name_prefix="hasten-listing") as pool:
            listing = pool.submit(st.sizes, target)
            removed = naming.clean_marked(parent, None if self.automatic else name)
            found = listing.result()
        if name in removed:
            found = st.sizes(target)
        complete = MANIFEST in found
        if not complete and found:
            raise ValueError(
                f"save_state: {target!r} exists, is not empty and is not a hasten checkpoint; "
                "refusing to replace it (choose another directory)"
            )
        self.previous, self.found = complete, sorted(n for n in found if n != MANIFEST)
        if not complete:
            self.made = target  # a new folder: a failed save removes what is there
        self.marker = naming.mark(parent, name)

    def hook_folder(self) -> str:
        """The folder the save pre-hooks get (``hook(models, weights, output_dir)``): the temporary
        folder on the disk (renamed into place with the rest); at a URL a local folder, whose files
        are uploaded into the checkpoint once the previous copy is deleted (``upload_hook_files``):
        a hook writes with ``open`` or ``save_pretrained`` either way, before anything is deleted."""
        if not self.store.url:
            return self.tmp
        if self.staging is None:
            import tempfile

            self.staging = tempfile.mkdtemp(prefix="hasten-pre-hook-")
        return self.staging

    def upload_hook_files(self) -> None:
        """At a URL: what the pre-hooks wrote into this process's local folder, uploaded into the
        checkpoint (after ``replace``, before the layout's files; not in the manifest, as on the disk)."""
        if self.staging is None:
            return
        for folder, _, names in os.walk(self.staging):
            for name in names:
                local = os.path.join(folder, name)
                relative = os.path.relpath(local, self.staging).replace(os.sep, "/")
                with open(local, "rb") as src, self.store.open(self.store.join(self.target, relative), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)

    def replace(self) -> bool:
        """At a URL, once every process built its plan and right before the first file is written:
        the main process deletes a previous copy, its manifest first (it is no checkpoint from then
        on), then every other object ``begin`` listed in the folder (one request). From here a
        failed save leaves no checkpoint in the folder. Whether a copy was deleted (the caller sets
        ``replaced`` on every process from the main process's answer)."""
        if not self.ctx.state.is_main_process:
            return False
        previous, self.previous = self.previous, False
        if previous:
            self.replaced = True  # from the manifest's deletion on, a failure says the previous copy is gone
            self.store.remove(self.store.join(self.target, MANIFEST))
            self.store.remove_all(self.target, self.found)  # what ``begin`` listed: no second listing
        self.made = self.target
        return previous

    def _commit_at_url(self, reports: list[Written]) -> None:
        """``commit`` at a URL: every process's files listed once and checked, the manifest written
        last (the checkpoint exists from then on), the mark deleted, rotation."""
        st, target = self.store, self.target
        written: dict[str, Any] = {}
        for report in reports:
            written.update(report.files)
        found = st.sizes(target)
        for file_name, rec in written.items():
            if found.get(file_name) != rec["size"]:
                raise RuntimeError(
                    f"save_state: {target!r} does not hold {file_name!r} as its process wrote it "
                    f"({rec['size']} bytes; found {found.get(file_name)})"
                )
        fields = reports[0].manifest
        assert fields is not None  # the main process's report
        manifest = build_manifest(self.layout, **fields.as_dict(), files=dict(sorted(written.items())))
        files.write_json(st.join(target, MANIFEST), manifest)
        self.made = None  # complete: a failure after this point keeps it
        if self.marker is not None:
            marker, self.marker = self.marker, None
            st.remove(marker)
        if self.total_limit is not None:
            naming.rotate(target.rsplit("/", 1)[0], self.total_limit, protect=target)


def _check_target(target: str) -> None:
    """``target`` is no link, no file, and empty or a hasten checkpoint (which a save replaces)."""
    parent, name = os.path.split(target)
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


def _rename_into_place(tmp: str, target: str) -> None:
    """``tmp`` renamed to ``target``; a previous copy there is renamed aside first and removed after."""
    parent, name = os.path.split(target)
    if os.path.isdir(target):
        old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)  # the previous copy back at its name
            raise
        files.fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    files.fsync_dir(parent)


# ---------------------------------------------------------------------- what interrupted saves left


def recover(parent: str, name: str | None, call: str) -> list[tuple[str, str]]:
    """``naming.recover`` with a warning for each checkpoint put back."""
    recovered = naming.recover(parent, name)
    for found, entry in recovered:
        errors.warn_user(
            f"{call}: {found!r} in {redact(parent)!r} was missing, a save having been interrupted between its two "
            f"renames; put back the complete copy {entry!r}"
        )
    return recovered


def recover_input_dir(directory: str) -> None:
    """``load_state(input_dir)`` of a folder that a crash left hidden: put it back, or say why not
    (at a URL nothing is hidden: a folder without its manifest is refused by ``read_manifest``)."""
    if storage.is_url(directory) or os.path.lexists(directory):
        return
    parent, name = os.path.split(directory)
    if recover(parent, name, "load_state"):
        return
    hidden = [entry for _, kind, entry in naming.leftovers(parent, name) if kind in ("tmp", "old")]
    if hidden:
        raise FileNotFoundError(
            f"load_state: no checkpoint directory at {directory!r}; what an interrupted save of it left "
            f"({', '.join(map(repr, hidden))}) is incomplete (no {MANIFEST} or missing files), nothing was loaded"
        )


def newest_told(root: str) -> str | None:
    """``newest_loadable`` after recovering interrupted re-saves, with one warning naming what
    newer than it was passed over (partial saves) and why."""
    recover(root, None, "load_state")
    found = newest_loadable(root)
    newest = -1 if found is None else naming.iteration_of(found)
    st = storage.of(root)
    skipped = [
        f"{name!r} (no {MANIFEST})"
        for n, name in naming.checkpoints(root)
        if n > newest and not st.isfile(st.join(root, name, MANIFEST))
    ]
    skipped += [
        f"{entry!r} (a save of {name!r} that did not finish)"
        for name, kind, entry in naming.leftovers(root)
        if kind == "tmp" and (naming.iteration_of(name) if naming.iteration_of(name) is not None else -1) > newest
    ]
    if skipped:
        errors.warn_user(
            f"load_state: passed over {', '.join(skipped)} in {redact(root)!r}: incomplete; "
            + (f"loading {found!r}, the newest complete checkpoint" if found else "no complete checkpoint is left")
        )
    return found


def newest_loadable(root: str) -> str | None:
    """The name of the newest ``checkpoint_N`` in ``root`` that ``load_state`` can read: one with
    a hasten manifest, or one a foreign layout (Accelerate's) recognises; half-written or
    unrelated folders are passed over."""
    st = storage.of(root)
    for _, name in reversed(naming.checkpoints(root)):
        path = st.join(root, name)
        if st.isfile(st.join(path, MANIFEST)) or (not st.url and foreign_layout(path) is not None):
            return name
    return None
