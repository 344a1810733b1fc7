"""Where automatically named checkpoints live, and their rotation (``total_limit``).

On the local disk and at a URL alike (``storage``). What differs: the locks (``locks``:
``fcntl.flock``) are the local disk's only, since an object store has no lock that is let go
when its holder dies; and an object store has no rename, so what an interrupted save or deletion
left there is marked by an object beside the folder (``.NAME.tmp-TOKEN``, ``mark``) rather than
by a hidden folder's name.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
import shutil
import socket

from hasten.checkpoint import storage
from hasten.checkpoint.errors import CheckpointError, warn_user
from hasten.checkpoint.files import fsync_dir
from hasten.checkpoint.locks import READ_ONLY, written_elsewhere
from hasten.checkpoint.manifest import MANIFEST
from hasten.settings.locations import redact

CHECKPOINTS = "checkpoints"
ITERATION = re.compile(r"checkpoint_(\d+)")
# What hasten's own renames leave behind when a process dies in the middle of them.
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{12}")


def checkpoints_root(project_dir: str | os.PathLike | None, call: str) -> str:
    if project_dir is None:
        raise ValueError(
            f"{call}() without a directory uses automatic naming under Accelerator(project_dir=...) "
            "(or ProjectConfiguration(project_dir=...)), but project_dir is None: pass a directory or set project_dir"
        )
    location = storage.check_location("ProjectConfiguration", "project_dir", project_dir)
    return storage.of(location).join(location, CHECKPOINTS)


def iteration_of(directory: str) -> int | None:
    """N for a directory named ``checkpoint_N``, else None."""
    match = ITERATION.fullmatch(os.path.basename(directory))
    return int(match.group(1)) if match else None


def checkpoints(root: str) -> list[tuple[int, str]]:
    """``(N, name)`` of every ``checkpoint_N`` directory in ``root``, oldest first."""
    entries = storage.of(root).listdir(root)
    found = (ITERATION.fullmatch(e) for e, folder in entries.items() if folder)
    return sorted((int(m.group(1)), m.group(0)) for m in found if m)


def iterations(root: str) -> list[int]:
    """The N of every ``checkpoint_N`` directory in ``root``, sorted."""
    return [n for n, _ in checkpoints(root)]


def newest_complete(root: str) -> str | None:
    """The newest ``checkpoint_N`` in ``root`` that has a manifest (a complete hasten checkpoint)."""
    st = storage.of(root)
    for _, name in reversed(checkpoints(root)):
        if st.isfile(st.join(root, name, MANIFEST)):
            return name
    return None


def remove_tree(path: str) -> None:
    """Rename aside (so a crash never leaves a half-deleted checkpoint at its name), then delete.
    At a URL: marked (``mark``), its manifest deleted first (it is no checkpoint from then on),
    then every other object, then the mark."""
    if storage.is_url(path):
        parent, name = posixpath.split(path)
        st = storage.of(path)
        marker = mark(parent, name)
        manifest = st.join(path, MANIFEST)
        if st.isfile(manifest):
            st.remove(manifest)
        st.rmtree(path)
        st.remove(marker)
        return
    if os.path.islink(path):
        raise CheckpointError(
            f"{path!r} is a symbolic link; hasten neither follows nor deletes links it did not create"
        )
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}.del-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(root: str, keep: int, protect: str) -> list[str]:
    """Keep the newest ``keep`` of hasten's checkpoints in ``root``; ``protect`` (the one just
    written) stays. A ``checkpoint_N`` folder without a hasten manifest is not hasten's: it is
    neither deleted nor counted, and a warning names it; nor is a symbolic link (hasten deletes
    nothing through a link it did not create). Returns the paths removed."""
    owned, foreign, links = [], [], []
    st = storage.of(root)
    for _, name in checkpoints(root):
        path = st.join(root, name)
        if not st.url and os.path.islink(path):
            links.append(path)
        else:
            (owned if st.isfile(st.join(path, MANIFEST)) else foreign).append(path)
    reasons = (
        (foreign, f"not written by hasten (no {MANIFEST})"),
        (links, "symbolic links, which hasten does not follow"),
    )
    for kept, why in reasons:
        if kept:
            warn_user(
                f"save_state: total_limit leaves {', '.join(repr(os.path.basename(p)) for p in kept)} in "
                f"{redact(root)!r} alone: {why}"
            )
    removed = []
    for path in owned[:-keep]:
        if path != protect:
            remove_tree(path)
            removed.append(path)
    return removed


def remove_leftovers(parent: str, name: str | None = None) -> None:
    """Remove what hasten's own interrupted saves left in ``parent`` (hidden ``.NAME.tmp-``,
    ``.old-`` and ``.del-`` folders): all of them, or those of checkpoint ``name`` only. Those of
    a folder that another run's save is writing now (``written_elsewhere``) are live, and kept;
    symbolic links are neither followed nor removed. At a URL: ``clean_marked``."""
    if storage.is_url(parent):
        clean_marked(parent, name)
        return
    if not os.path.isdir(parent):
        return
    live: dict[str, bool] = {}
    for entry in os.listdir(parent):
        m = _LEFTOVER.fullmatch(entry)
        if m and (name is None or m.group("name") == name):
            found = m.group("name")
            if live.setdefault(found, written_elsewhere(parent, found)):
                continue
            path = os.path.join(parent, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)


def leftovers(parent: str, name: str | None = None) -> list[tuple[str, str, str]]:
    """``(checkpoint name, kind, entry)`` of the hidden folders hasten's interrupted saves left in
    ``parent`` (kind ``tmp``: being written; ``old``: the previous copy of a re-saved folder;
    ``del``: being deleted), of every checkpoint or of ``name`` only; sorted by entry. At a URL:
    ``(name, "tmp", mark)`` for each mark (``marks``)."""
    if storage.is_url(parent):
        return [(found, "tmp", posixpath.basename(m)) for found, m in marks(parent, name)]
    if not os.path.isdir(parent):
        return []
    found = []
    for entry in sorted(os.listdir(parent)):
        m = _LEFTOVER.fullmatch(entry)
        path = os.path.join(parent, entry)
        if m and (name is None or m.group("name") == name) and os.path.isdir(path) and not os.path.islink(path):
            found.append((m.group("name"), m.group("kind"), entry))
    return found


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a hasten manifest and every file it lists, at its recorded size."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(path, n)) == rec["size"] for n, rec in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return False


def recover(parent: str, name: str | None = None) -> list[tuple[str, str]]:
    """Put back at its name each checkpoint of ``parent`` (or ``name`` only) that a crash between the
    two renames of a re-save left hidden: the new copy (``.NAME.tmp-*``) if it is complete (it
    has its manifest, written before the renames), else the previous one (``.NAME.old-*``).
    Nothing is done where the name exists or no hidden copy is complete. Returns ``(name, entry
    put back)``; call it before ``remove_leftovers``, which would delete both. A folder another run's
    save is writing now is left to it, and in a folder that cannot be written nothing is put back.
    At a URL nothing is ever hidden (no renames there): nothing to do."""
    if storage.is_url(parent):
        return []
    recovered = []
    by_name: dict[str, list[tuple[str, str]]] = {}
    for leftover_name, kind, entry in leftovers(parent, name):
        by_name.setdefault(leftover_name, []).append((kind, entry))
    for leftover_name, entries in by_name.items():
        target = os.path.join(parent, leftover_name)
        if os.path.lexists(target) or written_elsewhere(parent, leftover_name):
            continue
        order = [e for k, e in entries if k == "tmp"] + [e for k, e in entries if k == "old"]
        complete = [e for e in order if is_complete(os.path.join(parent, e))]
        if complete:
            try:
                os.rename(os.path.join(parent, complete[0]), target)
            except OSError as e:
                if e.errno in READ_ONLY:
                    continue  # a read-only copy: what is complete there is loaded as it is
                raise
            recovered.append((leftover_name, complete[0]))
    if recovered:
        fsync_dir(parent)
    return recovered


# ---------------------------------------------------------------------- at a URL: marks, not renames
#
# An object store has no rename: a save writes its files straight into the checkpoint's folder,
# and the manifest last. Before its first file, the main process puts a mark beside the folder
# (the object ``.NAME.tmp-TOKEN``, holding its pid and host); the commit deletes it after the
# manifest. A deletion (rotation) marks the folder too, deletes the manifest first, then the
# rest, then the mark. A mark left behind means a save or deletion was interrupted: the next
# save removes the folder, unless it has its manifest (interrupted after it: only the mark goes).


def mark(parent: str, name: str) -> str:
    """Put a mark beside the folder ``parent/name`` (a change to it in progress); its path."""
    st = storage.of(parent)
    marker = st.join(parent, f".{name}.tmp-{secrets.token_hex(6)}")
    with st.open(marker, "wb") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}\n".encode())
    return marker


def marks(parent: str, name: str | None = None) -> list[tuple[str, str]]:
    """``(folder name, mark's path)`` of each mark in ``parent`` (of folder ``name`` only), sorted."""
    st = storage.of(parent)
    found = []
    for entry in st.files_starting(parent, "." if name is None else f".{name}.tmp-"):  # one listing of the marks
        m = _LEFTOVER.fullmatch(entry)
        if m and m.group("kind") == "tmp" and (name is None or m.group("name") == name):
            found.append((m.group("name"), st.join(parent, entry)))
    return found


def clean_marked(parent: str, name: str | None = None) -> set[str]:
    """Remove what interrupted saves and deletions left in ``parent`` (a URL; of folder ``name``
    only): each marked folder without its manifest, and each mark. The names of the folders removed."""
    st = storage.of(parent)
    removed = set()
    for found, marker in marks(parent, name):
        folder = st.join(parent, found)
        if not st.isfile(st.join(folder, MANIFEST)):
            st.rmtree(folder)
            removed.add(found)
        st.remove(marker)
    return removed
