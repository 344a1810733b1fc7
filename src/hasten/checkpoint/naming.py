"""Where automatically named checkpoints live, and their rotation (``total_limit``)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import warnings
import weakref
from typing import Any

from .errors import CheckpointError
from .io import fsync_dir
from .manifest import MANIFEST

CHECKPOINTS = "checkpoints"
ITERATION = re.compile(r"checkpoint_(\d+)")
LOCK_FILE = ".hasten-lock"  # the lock of a checkpoints folder: a hidden file inside it
# What hasten's own renames leave behind when a process dies in the middle of them.
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{12}")


def checkpoints_root(project_dir: str | os.PathLike | None, call: str) -> str:
    if project_dir is None:
        raise ValueError(
            f"{call}() without a directory uses automatic naming under Accelerator(project_dir=...) "
            "(or ProjectConfiguration(project_dir=...)), but project_dir is None: pass a directory or set project_dir"
        )
    return os.path.join(os.path.abspath(project_dir), CHECKPOINTS)


def iteration_of(directory: str) -> int | None:
    """N for a directory named ``checkpoint_N``, else None."""
    match = ITERATION.fullmatch(os.path.basename(directory))
    return int(match.group(1)) if match else None


def checkpoints(root: str) -> list[tuple[int, str]]:
    """``(N, name)`` of every ``checkpoint_N`` directory in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = (ITERATION.fullmatch(e) for e in os.listdir(root))
    return sorted((int(m.group(1)), m.group(0)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def iterations(root: str) -> list[int]:
    """The N of every ``checkpoint_N`` directory in ``root``, sorted."""
    return [n for n, _ in checkpoints(root)]


def newest_complete(root: str) -> str | None:
    """The newest ``checkpoint_N`` in ``root`` that has a manifest (a complete hasten checkpoint)."""
    for _, name in reversed(checkpoints(root)):
        if os.path.isfile(os.path.join(root, name, MANIFEST)):
            return name
    return None


def remove_tree(path: str) -> None:
    """Rename aside (so a crash never leaves a half-deleted checkpoint at its name), then delete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}.del-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(root: str, keep: int, protect: str) -> list[str]:
    """Keep the newest ``keep`` of hasten's checkpoints in ``root``; ``protect`` (the one just
    written) stays. A ``checkpoint_N`` folder without a hasten manifest is not hasten's: it is
    neither deleted nor counted, and a warning names it. Returns the paths removed."""
    owned, foreign = [], []
    for _, name in checkpoints(root):
        path = os.path.join(root, name)
        (owned if os.path.isfile(os.path.join(path, MANIFEST)) else foreign).append(path)
    if foreign:
        warnings.warn(
            f"save_state: total_limit leaves {', '.join(repr(os.path.basename(p)) for p in foreign)} in {root!r} "
            f"alone: not written by hasten (no {MANIFEST})",
            stacklevel=4,
        )
    removed = []
    for path in owned[:-keep]:
        if path != protect:
            remove_tree(path)
            removed.append(path)
    return removed


def remove_leftovers(parent: str, name: str | None = None) -> None:
    """Remove what hasten's own interrupted saves left in ``parent`` (hidden ``.NAME.tmp-``,
    ``.old-`` and ``.del-`` folders): all of them, or those of checkpoint ``name`` only."""
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        m = _LEFTOVER.fullmatch(entry)
        if m and (name is None or m.group("name") == name):
            path = os.path.join(parent, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)


def leftovers(parent: str, name: str | None = None) -> list[tuple[str, str, str]]:
    """``(checkpoint name, kind, entry)`` of the hidden folders hasten's interrupted saves left in
    ``parent`` (kind ``tmp``: being written; ``old``: the previous copy of a re-saved folder;
    ``del``: being deleted), of every checkpoint or of ``name`` only; sorted by entry."""
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
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def recover(parent: str, name: str | None = None) -> list[tuple[str, str]]:
    """Put back at its name each checkpoint of ``parent`` (or ``name`` only) that a crash between the
    two renames of a re-save left hidden: the new copy (``.NAME.tmp-*``) if it is complete (it
    has its manifest, written before the renames), else the previous one (``.NAME.old-*``).
    Nothing is done where the name exists or no hidden copy is complete. Returns ``(name, entry
    put back)``; call it before ``remove_leftovers``, which would delete both."""
    recovered = []
    by_name: dict[str, list[tuple[str, str]]] = {}
    for leftover_name, kind, entry in leftovers(parent, name):
        by_name.setdefault(leftover_name, []).append((kind, entry))
    for leftover_name, entries in by_name.items():
        target = os.path.join(parent, leftover_name)
        if os.path.lexists(target):
            continue
        order = [e for k, e in entries if k == "tmp"] + [e for k, e in entries if k == "old"]
        complete = [e for e in order if is_complete(os.path.join(parent, e))]
        if complete:
            os.rename(os.path.join(parent, complete[0]), target)
            recovered.append((leftover_name, complete[0]))
    if recovered:
        fsync_dir(parent)
    return recovered


# ---------------------------------------------------------------------- one run per folder

_held: dict[str, list[Any]] = {}  # real path of the folder -> [open lock file, number of holders]


def lock_folder(root: str, owner: object, call: str = "save_state") -> None:
    """Hold an exclusive lock on the checkpoint folder ``root`` while ``owner`` lives.

    One run per folder: a second process gets a ``CheckpointError`` naming the folder and the pid
    and host of the process holding it (``call`` says who asked). The lock is an ``fcntl`` lock on
    the hidden file ``.hasten-lock`` in the folder (so ``project_dir`` holds nothing but
    ``checkpoints``, as with Accelerate), so the
    operating system releases it when the holding process exits or crashes. Several owners
    in one process share it. Without ``fcntl`` (Windows) nothing is locked.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        return
    key = os.path.realpath(root)
    holders = getattr(owner, "_hasten_locks", None)
    if holders is None:
        holders = set()
        owner._hasten_locks = holders  # type: ignore[attr-defined]
    if key in holders:
        return
    if key not in _held:
        os.makedirs(key, exist_ok=True)
        f = open(os.path.join(key, LOCK_FILE), "a+")  # noqa: SIM115 - kept open while held
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().split()
            f.close()
            who = f"pid {holder[0]}" + (f" on host {holder[1]}" if len(holder) > 1 else "") if holder else "pid unknown"
            raise CheckpointError(
                f"{call}: the checkpoint folder {root!r} is in use by another run ({who}); two runs "
                "in one folder would overwrite each other's checkpoints. Give this run its own project_dir, "
                "or stop the other run first"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} {socket.gethostname()}\n")
        f.flush()
        _held[key] = [f, 0]
    _held[key][1] += 1
    holders.add(key)
    weakref.finalize(owner, _release, key)


def _release(key: str) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        entry[0].close()  # closing the file releases the lock
