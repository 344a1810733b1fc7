"""Where automatically named checkpoints live, and their rotation (``total_limit``).

On the local disk and at a URL alike (``storage``). What differs is below: the locks
(``fcntl.flock``) are the local disk's only, since an object store has no lock that is let go
when its holder dies; and an object store has no rename, so what an interrupted save or deletion
left there is marked by an object beside the folder (``.NAME.tmp-TOKEN``, ``mark``) rather than
by a hidden folder's name.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import secrets
import shutil
import socket
import stat
import time
import warnings
import weakref
from typing import Any

from hasten.checkpoint import storage
from hasten.checkpoint.errors import CheckpointError, describe_os_error
from hasten.checkpoint.files import fsync_dir
from hasten.checkpoint.manifest import MANIFEST

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
            warnings.warn(
                f"save_state: total_limit leaves {', '.join(repr(os.path.basename(p)) for p in kept)} in {root!r} "
                f"alone: {why}",
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
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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
                if e.errno in _READ_ONLY:
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
    for entry, folder in sorted(st.listdir(parent).items()):
        m = _LEFTOVER.fullmatch(entry)
        if m and not folder and m.group("kind") == "tmp" and (name is None or m.group("name") == name):
            found.append((m.group("name"), st.join(parent, entry)))
    return found


def clean_marked(parent: str, name: str | None = None) -> None:
    """Remove what interrupted saves and deletions left in ``parent`` (a URL; of folder ``name``
    only): each marked folder without its manifest, and each mark."""
    st = storage.of(parent)
    for found, marker in marks(parent, name):
        folder = st.join(parent, found)
        if not st.isfile(st.join(folder, MANIFEST)):
            st.rmtree(folder)
        st.remove(marker)


# ---------------------------------------------------------------------- one writer per folder
#
# Only on the local disk (``DISK_ONLY``).
# Two kinds of lock, both ``fcntl.flock`` locks on hidden files, which the operating system
# releases when the holding process exits or crashes (so a dead run never keeps a folder):
# ``.hasten-lock`` in ``project_dir/checkpoints`` (automatic naming), held by one run for as long
# as its Accelerator lives (``lock_folder``); and ``.hasten-lock.NAME`` beside a folder NAME that
# ``save_state(output_dir)`` writes, held by that save from before its temporary folder exists
# until the folder is renamed into place (or the save failed and its temporary folder is
# removed), then deleted (``claim``). Each is opened without following a symbolic link; a link,
# or anything but a regular file, at its place is refused by name and left as it is.

DISK_ONLY = (
    "the lock that keeps two runs off one checkpoint folder is the local disk's (fcntl.flock, let go by the "
    "operating system when its holder dies); an object store has no lock that its holder's death lets go, "
    "nor a create-if-absent that every fsspec protocol offers, so at a URL nothing is locked: give each run "
    "its own project_dir or output_dir there"
)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # the folder cannot be written: nothing to lock
_held: dict[str, list[Any]] = {}  # real path of the folder -> [lock's file descriptor, number of holders]
_claimed: set[str] = set()  # real paths of the name locks (``claim``) this process holds


def _not_a_lock(folder: str, entry: str, call: str) -> CheckpointError | None:
    """The refusal of a symbolic link or of anything but a regular file at ``folder/entry``; None otherwise."""
    try:
        mode = os.lstat(os.path.join(folder, entry)).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        why = "is a symbolic link; hasten does not follow links it did not create: remove it"
    elif not stat.S_ISREG(mode):
        why = "is not a regular file; hasten keeps its lock file there: remove it"
    else:
        return None
    return CheckpointError(f"{call}: {entry!r} in {folder!r} {why}")


def _open_lock(folder: str, entry: str, call: str, create: bool) -> int | None:
    """A file descriptor of the lock file ``folder/entry``, never opened through a symbolic link:
    with ``create``, read-write, the file created exclusively where absent; without, read-only,
    None where absent. A link or a non-regular file there is a ``CheckpointError``."""
    path = os.path.join(folder, entry)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    while True:
        try:
            if create:
                try:
                    return os.open(path, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    pass
            fd = os.open(path, flags | (os.O_RDWR if create else os.O_RDONLY))
        except FileNotFoundError:
            if create and os.path.isdir(folder):
                continue  # deleted in between (a name lock's holder deletes it as it finishes): create it
            if create:
                raise
            return None
        except OSError:
            refused = _not_a_lock(folder, entry, call)
            if refused is not None:
                raise refused from None
            raise
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        raise _not_a_lock(folder, entry, call) or CheckpointError(
            f"{call}: {entry!r} in {folder!r} is not a regular file"
        )


def _take(fd: int, shared: bool = False) -> bool:
    """Whether the ``flock`` on ``fd`` was taken (False: another open file holds it)."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> str:
    """``pid P on host H``, as the holder of the lock file ``fd`` wrote them (it writes them right
    after taking the lock: a moment is waited for them)."""
    deadline = time.monotonic() + 1.0
    while True:
        words = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
        if words or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if not words:
        return "pid unknown"
    return f"pid {words[0]}" + (f" on host {words[1]}" if len(words) > 1 else "")


def _stamp(fd: int) -> None:
    """Write this process's pid and host into the lock file ``fd``, once its lock is held."""
    line = f"{os.getpid()} {socket.gethostname()}\n".encode()
    os.pwrite(fd, line, 0)
    os.ftruncate(fd, len(line))


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _in_use(call: str, root: str, who: str) -> CheckpointError:
    return CheckpointError(
        f"{call}: the checkpoint folder {root!r} is in use by another run ({who}); two runs "
        "in one folder would overwrite each other's checkpoints. Give this run its own project_dir, "
        "or stop the other run first"
    )


def _unwritable(call: str, folder: str, err: OSError) -> CheckpointError:
    return CheckpointError(
        f"{call}: cannot write in the checkpoint folder {folder!r}: {describe_os_error(err)}; the checkpoints "
        "of a read-only folder can be loaded, not saved there. Nothing was written: give this run a writable folder"
    )


def lock_folder(root: str, owner: object, call: str = "save_state", read_only_ok: bool = False) -> None:
    """Hold an exclusive lock on the checkpoint folder ``root`` while ``owner`` lives.

    One run per folder: a second process gets a ``CheckpointError`` naming the folder and the pid
    and host of the process holding it (``call`` says who asked). The lock is the hidden file
    ``.hasten-lock`` in the folder (so ``project_dir`` holds nothing but ``checkpoints``, as with
    Accelerate); several owners in one process share it. A folder that cannot be written
    (read-only, no permission) is a ``CheckpointError`` saying so, or with ``read_only_ok`` is
    left unlocked: nothing can be written there, and the first save asks again (and is refused).
    Without ``fcntl`` (Windows), or at a URL (``DISK_ONLY``), nothing is locked.
    """
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - not on POSIX
        return
    if storage.is_url(root):
        return
    key = os.path.realpath(root)
    holders = getattr(owner, "_hasten_locks", None)
    if holders is None:
        holders = set()
        owner._hasten_locks = holders  # type: ignore[attr-defined]
    if key in holders:
        return
    if key not in _held:
        try:
            os.makedirs(key, exist_ok=True)
            fd = _open_lock(key, LOCK_FILE, call, create=True)
        except OSError as e:
            if e.errno not in _READ_ONLY:
                raise
            if read_only_ok:
                return
            raise _unwritable(call, root, e) from None
        assert fd is not None
        if not _take(fd):
            who = _holder(fd)
            os.close(fd)
            raise _in_use(call, root, who)
        _stamp(fd)
        _held[key] = [fd, 0]
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
        os.close(entry[0])  # closing the file releases the lock


class Claim:
    """A save's hold on writing one checkpoint folder (``claim``); ``release`` ends it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Delete the lock file while still holding it (the next writer creates a new one), then let go."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _claimed.discard(self.path)
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # left behind, it is taken over by the next save of the folder
        finally:
            os.close(fd)


def _check_folder_free(parent: str, folder: str, call: str) -> None:
    """Refuse a save into ``parent`` while another run holds it as its checkpoints folder."""
    if folder in _held:
        return  # this process's own
    fd = _open_lock(folder, LOCK_FILE, call, create=False)
    if fd is None:
        return
    try:
        if not _take(fd, shared=True):
            raise _in_use(call, parent, _holder(fd))
    finally:
        os.close(fd)  # closing it lets go of the shared lock just taken


def claim(parent: str, name: str, call: str = "save_state") -> Claim | None:
    """Take the lock ``.hasten-lock.NAME`` in ``parent`` for the save that writes ``parent/name``.

    One writer per checkpoint folder: while another run's save of that folder holds it (or another
    run holds ``parent`` as its checkpoints folder), a ``CheckpointError`` names that run (pid,
    host) and nothing is written. The lock file is created here and deleted by ``release``; one a
    crashed save left is taken over. None without ``fcntl`` (Windows), or at a URL (``DISK_ONLY``).
    """
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    if storage.is_url(parent):
        return None
    folder = os.path.realpath(parent)
    entry = f"{LOCK_FILE}.{name}"
    path = os.path.join(folder, entry)
    try:
        os.makedirs(folder, exist_ok=True)
        _check_folder_free(parent, folder, call)
        while True:
            fd = _open_lock(folder, entry, call, create=True)
            assert fd is not None
            if not _take(fd):
                who = _holder(fd)
                os.close(fd)
                raise CheckpointError(
                    f"{call}: {os.path.join(parent, name)!r} is being written by another run ({who}); two runs "
                    "writing one checkpoint folder would delete each other's files. Nothing was written: "
                    "give each run its own folder, or save again once that save has finished"
                )
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder deleted it as it finished: take the one now there
    except OSError as e:
        if e.errno not in _READ_ONLY:
            raise
        raise _unwritable(call, parent, e) from None
    _stamp(fd)
    _claimed.add(path)
    return Claim(path, fd)


def written_elsewhere(parent: str, name: str) -> bool:
    """Whether a save of another run is writing ``parent/name`` now: its ``.hasten-lock.NAME`` is
    held. Where that cannot be told (the file is a link, or unreadable), True: what belongs to that
    name is left alone."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - not on POSIX
        return False
    if storage.is_url(parent):
        return False
    folder = os.path.realpath(parent)
    if os.path.join(folder, f"{LOCK_FILE}.{name}") in _claimed:
        return False  # the caller's own save
    try:
        fd = _open_lock(folder, f"{LOCK_FILE}.{name}", "save_state", create=False)
        if fd is None:
            return False
        try:
            return not _take(fd, shared=True)
        finally:
            os.close(fd)
    except (OSError, CheckpointError):
        return True
