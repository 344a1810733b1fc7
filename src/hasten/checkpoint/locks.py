"""One writer per checkpoint folder: the local disk's locks (``fcntl.flock``).

Split from ``naming`` (where automatically named checkpoints live, their rotation and what
interrupted saves left), which asks ``written_elsewhere`` before removing anything.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import time
import weakref
from typing import Any

from hasten.checkpoint import storage
from hasten.checkpoint.errors import CheckpointError, describe_os_error

LOCK_FILE = ".hasten-lock"  # the lock of a checkpoints folder: a hidden file inside it

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
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # the folder cannot be written: nothing to lock
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
            if e.errno not in READ_ONLY:
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
        if e.errno not in READ_ONLY:
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
