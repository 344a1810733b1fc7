"""Checkpoint files on disk or at a URL (``storage``): atomic, fsynced writes that hash what they write, and paths.

Every file is written then fsynced (``write``); a file that replaces another goes through a
temporary name and a rename (``replace_file``). What ``write`` (and ``dcp_io.dcp_writer``)
write inside ``recording()`` is hashed as it is written (``_Recording``), so the manifest needs
no second pass over the files; an operating-system failure names its file, whatever the writer
(``torch.save``) made of it. Large files are sent to the disk as they are written (``_write_back``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
import secrets
import sys
from collections.abc import Callable
from typing import Any

from hasten import _validate as v
from hasten.checkpoint import storage
from hasten.checkpoint.checksums import CHECKSUM, hasher, record
from hasten.settings.locations import refuse_url

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# Start writing a file's bytes to the disk every this many bytes written (see ``_write_back``).
WRITE_BACK_BYTES = 32 << 20


def _write_back(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to the disk now
    (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a hint, nothing where the call does not
    exist or fails: the fsync that follows makes the bytes durable either way).

    Without it the kernel keeps a checkpoint's bytes in the page cache until the fsync at its
    end (or until its background threshold of dirty memory, a tenth of it by default), and the
    fsync then waits for the disk to write them all: with it the disk writes while the next
    bytes are produced, and the fsync waits only for the tail. The pages stay cached (a load
    right after reads them from memory). Once the kernel's own flusher is at work
    (``_kernel_writes_back``) the hint is left out: it would only block this thread while the
    disk's queue is full (bench row 13: a ~1B-parameter save took 1.2x as long with it)."""
    fn = _sync_file_range()
    if fn is not None and not _kernel_writes_back():
        fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; its failure (a pipe, an old kernel) changes nothing


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _background_threshold() -> tuple[int, int]:
    """``(vm.dirty_background_bytes, vm.dirty_background_ratio)``."""
    with open("/proc/sys/vm/dirty_background_bytes") as f, open("/proc/sys/vm/dirty_background_ratio") as g:
        return int(f.read()), int(g.read())


def _kernel_writes_back() -> bool:
    """Whether the dirty and in-flight pages of the whole machine (``Dirty`` + ``Writeback`` of
    /proc/meminfo) reach half the kernel's background threshold (``vm.dirty_background_bytes``,
    else ``vm.dirty_background_ratio`` percent of the available memory), where its flusher
    writes them back by itself; False where /proc cannot tell."""
    try:
        by_bytes, ratio = _background_threshold()
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Dirty", "Writeback", "MemAvailable"):
                    info[key] = int(value.split()[0]) * 1024
        threshold = by_bytes or ratio * info["MemAvailable"] // 100
        return info["Dirty"] + info["Writeback"] >= threshold // 2
    except (OSError, ValueError, KeyError):
        return False


def fsync_files(paths: list[str]) -> None:
    """fsync each of ``paths`` (files written and closed earlier, unsynced); an OS failure is an
    OSError naming its file (a failed fsync means the bytes may never reach the disk). A URL's
    object is durable once its upload returned: nothing to do."""
    for path in paths:
        if storage.is_url(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
        finally:
            os.close(fd)


class _Recording:
    """A file object that keeps the OSError its ``write`` raised (``torch.save`` turns it into
    ``[enforce fail at inline_container.cc:...] unexpected pos``, which names no cause) and
    hashes what is written through it, so a checkpoint's checksum costs no second pass over the
    file (a ``seek`` makes the running hash unusable: the file is hashed again if it is needed).

    With ``parts`` (DCP's files), the file is hashed in parts instead of whole, each stretch
    between two ``tell()`` calls on its own (DCP's writer asks for the position before and after
    each item it writes): ``[offset, length, xxh3_128]`` in ``record()["parts"]``, which tile
    the file from its first byte to its last. A process reading some items of a file verifies
    exactly the bytes it reads, as it reads them (``dcp_reader``), and the whole file is
    verified part by part (``verify_file``): every byte is hashed once as it is written, not
    once for the file and again for its item."""

    def __init__(self, f: Any, parts: bool = False) -> None:
        self._f = f
        self.error: OSError | None = None
        self._hash: Any = hasher()  # of the whole file, or (parts) of the bytes since _part_at
        self._size = 0
        self._parts: list[list[Any]] | None = [] if parts else None
        self._part_at = 0
        self._written = self._sent = 0  # bytes written through this object; of those, sent to the disk
        try:
            self._fd: int | None = f.fileno() if f is not None else None
        except (AttributeError, OSError, ValueError):  # not a file of the OS (io.UnsupportedOperation is both)
            self._fd = None

    def write(self, data: Any) -> Any:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = e
            raise
        view = memoryview(data).cast("B")
        if n is not None and n < view.nbytes:
            view = view[:n]
        if self._hash is not None:
            self._hash.update(view)
            self._size += view.nbytes
        self._written += view.nbytes
        if self._fd is not None and self._written - self._sent >= WRITE_BACK_BYTES:
            # what was written before the last few bytes reached the OS (a buffered file keeps
            # at most its buffer), so the disk can write it while the rest is produced
            _write_back(self._fd, self._sent, self._written - self._sent)
            self._sent = self._written
        return n

    def tell(self) -> int:
        pos = self._f.tell()
        if self._parts is not None and self._hash is not None:
            if pos != self._size:  # not where the bytes written end (a file opened to append): no parts
                self._hash = None
            else:
                self._close_part()
        return pos

    def _close_part(self) -> None:
        if self._size > self._part_at:
            self._parts.append([self._part_at, self._size - self._part_at, self._hash.hexdigest()])  # type: ignore[union-attr]
            self._hash, self._part_at = hasher(), self._size

    def seek(self, *args: Any) -> Any:
        self._hash = None
        return self._f.seek(*args)

    def record(self) -> dict[str, Any] | None:
        """``{"size", "xxh3_128"}`` (or ``{"size", "parts"}``) of what was written, if it was written in one pass."""
        if self._hash is None:
            return None
        if self._parts is None:
            return {"size": self._size, CHECKSUM: self._hash.hexdigest()}
        self._close_part()
        return {"size": self._size, "parts": [list(p) for p in self._parts]}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# The records (path -> size and checksum) of the files written in this context: ``recording()``
# collects them while a checkpoint is written, so that the manifest needs no pass over the files.
_records: contextvars.ContextVar[dict[str, dict[str, Any]] | None] = contextvars.ContextVar(
    "hasten_records", default=None
)


def active_records() -> dict[str, dict[str, Any]] | None:
    """The records of the ``recording()`` active here, if any."""
    return _records.get()


@contextlib.contextmanager
def recording() -> Any:
    """Collect ``{path: {"size", "xxh3_128"}}`` (``{"size", "parts"}`` for DCP's files) of every
    file ``write`` and ``dcp_writer`` write in this context (a ``dcp_writer`` made here records into it from any
    thread)."""
    records: dict[str, dict[str, Any]] = {}
    token = _records.set(records)
    try:
        yield records
    finally:
        _records.reset(token)


def keep_record(records: dict[str, dict[str, Any]] | None, path: str | os.PathLike, f: _Recording) -> None:
    rec = f.record()
    if records is not None and rec is not None:
        records[storage.key(path)] = rec


def recorded(records: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The record of ``path`` as written (its size checked now; at a URL, by the commit's listing),
    else its size and checksum read back."""
    rec = records.get(storage.key(path))
    if rec is not None and (storage.is_url(path) or os.path.getsize(path) == rec["size"]):
        return dict(rec)
    return record(path)


@contextlib.contextmanager
def naming_os_errors(f: Any, path: str | os.PathLike, parts: bool = False) -> Any:
    """``f`` wrapped so that any failure caused by the operating system (disk full, file too
    large, no permission) is raised as an OSError naming ``path``, whatever the writer made of it
    (and hashed as it is written, see ``_Recording``)."""
    rec = _Recording(f, parts)
    try:
        yield rec
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
        raise
    except Exception:
        if rec.error is not None and rec.error.errno is not None:
            raise OSError(rec.error.errno, rec.error.strerror, os.fspath(path)) from None
        raise


def write(path: str, writer: Callable[[Any], None]) -> None:
    """Create ``path``, let ``writer`` fill it, fsync it; an OS failure is an OSError naming ``path``.
    At a URL the object is uploaded as it is written, and is there, whole, once this returns."""
    records = _records.get()
    if storage.is_url(path):
        with naming_os_errors(None, path), storage.open(path, "wb") as raw, naming_os_errors(raw, path) as f:
            writer(f)
        keep_record(records, path, f)
        return
    with naming_os_errors(None, path), open(path, "wb") as raw, naming_os_errors(raw, path) as f:
        writer(f)
        f.flush()
        os.fsync(f.fileno())
    keep_record(records, path, f)


def write_json(path: str, obj: Any) -> None:
    write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def replace_file(path: str, writer: Callable[[Any], None]) -> None:
    """Write ``path`` atomically: a temporary file in the same directory, fsync, rename (at a URL,
    one upload: an object appears whole or not at all)."""
    if storage.is_url(path):
        write(path, writer)
        return
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
    try:
        write(tmp, writer)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory or ".")


def check_path(owner: str, field: str, value: Any) -> str:
    """``value`` as an absolute local path. A URL (``s3://...``) is refused, never taken as a local
    path (a folder named ``s3:``); the calls that take URLs use ``storage.check_location``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")
    path = os.fspath(value)
    refuse_url(owner, field, path, "save_state, load_state, save_model, load_model, save, load and merge-weights")
    if storage.is_url(path):  # file://
        return storage.check_location(owner, field, path)
    return os.path.abspath(path)


def parse_size(value: int | str, field: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"10GB"``, ``"500MB"`` or ``"2GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return v.check_number("save_model", field, value, integer=True, ge=1)
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"save_model.{field} must be a positive number of bytes or a string like '10GB', '500MB' or '2GiB', "
            f"got {value!r}"
        )
    return max(1, int(float(match.group(1)) * _UNITS[unit]))


def require_listed(paths: list[str], index: str, where: str) -> None:
    """Every file at a URL that the index ``index`` lists is there, checked before anything is
    read: else a FileNotFoundError naming the missing one (an object store's own error names
    no more than a key). A local file missing is the OS's error when it is opened, as before."""
    for path in paths:
        if storage.is_url(path) and not storage.isfile(path):
            raise FileNotFoundError(
                f"{where}: {index!r} lists the file {path.rpartition('/')[2]!r}, which is not there ({path!r} "
                "does not exist); nothing was loaded"
            )


def inside(directory: str, name: Any, where: str) -> str:
    """The path of file ``name`` (as a manifest lists it) in ``directory``; an error if it leaves it."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(
            f"{where}: the manifest names the file {name!r}, which is not a relative path inside the checkpoint"
        )
    if storage.is_url(directory):  # no links in an object store: no part may climb out of the folder
        if "\\" in name or any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(
                f"{where}: the manifest names the file {name!r}, which lies outside the checkpoint folder; "
                "refusing to read it"
            )
        return f"{directory}/{name}"
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise ValueError(
            f"{where}: the manifest names the file {name!r}, which lies outside the checkpoint folder; "
            "refusing to read it"
        )
    return path
