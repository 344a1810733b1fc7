"""File I/O for checkpoints: atomic writes, checksums, and model weights in safetensors or torch files.

Every file is written then fsynced (``write``); a file that replaces another goes through a
temporary name and a rename (``replace_file``). Tied weights are stored once in safetensors
files and listed in their ``hasten_aliases`` metadata (``safetensors_payload``), which
``read_weights`` resolves again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import io as pyio
import json
import mmap
import os
import re
import secrets
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _validate as v
from . import unpickle
from .errors import DamagedCheckpoint, UnsafeCheckpoint

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
ALIASES_KEY = "hasten_aliases"


# torch.distributed.checkpoint warns at every save and load without a process group that it
# assumes one process, which is what hasten means there. The filter that silences it is added
# when this module is imported (at ``Accelerator(...)``) and again only if it is no longer the
# first to match (``quiet_dcp``), never around each call: leaving ``warnings.catch_warnings``
# invalidates Python's registry of the warnings already shown, so every once-only warning
# (torch's included) was printed again after each save.
DCP_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def quiet_dcp() -> None:
    """Make sure the filter that silences DCP's one-process warning is the first to match it;
    it is added (one change of the filters) only where it is not."""
    for action, message, category, _module, _line in warnings.filters:
        if (message is None or message.match(DCP_NO_DIST_WARNING)) and issubclass(UserWarning, category):
            if action == "ignore" and message is not None and message.pattern == DCP_NO_DIST_WARNING:
                return
            break
    warnings.filterwarnings("ignore", message=DCP_NO_DIST_WARNING, category=UserWarning)


quiet_dcp()


# ---------------------------------------------------------------------- files


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
    OSError naming its file (a failed fsync means the bytes may never reach the disk)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
        finally:
            os.close(fd)


# The checksum of new checkpoints: XXH3-128 (the ``xxhash`` package), ~28 GB/s on one core here
# against SHA-256's ~1.8 GB/s, so hashing every byte written or read costs next to nothing. It
# detects accidental damage (a flipped bit, a truncated or stale file), not a forger. Records of
# earlier checkpoints carry "sha256" and are still verified with it.
CHECKSUM = "xxh3_128"
CHECKSUMS = (CHECKSUM, "sha256")


def hasher(algorithm: str = CHECKSUM) -> Any:
    """A new running hash (``update``, ``hexdigest``) of ``algorithm`` (one of ``CHECKSUMS``)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def checksum_of(rec: Any) -> tuple[str, str] | None:
    """``(algorithm, hex digest)`` of a manifest's file record, None if it records none."""
    if isinstance(rec, dict):
        for algorithm in CHECKSUMS:
            if isinstance(rec.get(algorithm), str):
                return algorithm, rec[algorithm]
    return None


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
_records: contextvars.ContextVar[dict[str, dict[str, Any]] | None] = contextvars.ContextVar("hasten_records", default=None)


@contextlib.contextmanager
def recording() -> Any:
    """Collect ``{path: {"size", "xxh3_128"}}`` (``{"size", "parts"}`` for DCP's files) of every
    file ``write`` and ``dcp_writer`` write in this context (a ``dcp_writer`` made here records into it from any thread)."""
    records: dict[str, dict[str, Any]] = {}
    token = _records.set(records)
    try:
        yield records
    finally:
        _records.reset(token)


def _keep(records: dict[str, dict[str, Any]] | None, path: str | os.PathLike, f: _Recording) -> None:
    rec = f.record()
    if records is not None and rec is not None:
        records[os.path.abspath(os.fspath(path))] = rec


def recorded(records: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The record of ``path`` as written (its size checked now), else its size and checksum read from disk."""
    rec = records.get(os.path.abspath(path))
    if rec is not None and os.path.getsize(path) == rec["size"]:
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
    """Create ``path``, let ``writer`` fill it, fsync it; an OS failure is an OSError naming ``path``."""
    records = _records.get()
    with naming_os_errors(None, path), open(path, "wb") as raw, naming_os_errors(raw, path) as f:
        writer(f)
        f.flush()
        os.fsync(f.fileno())
    _keep(records, path, f)


def dcp_writer(path: str, sync_files: bool = True) -> Any:
    """torch.distributed.checkpoint's ``FileSystemWriter`` for ``path`` whose OS failures name
    their file, and which records the size and checksum of each file (and of each item in it) it writes (into the
    ``recording()`` active where it is made) as it writes it. ``writer.hasten_files``: the files
    it wrote (``.metadata`` on the coordinating process); with ``sync_files=False`` they are
    left unsynced, for the caller to ``fsync_files`` once everything is written."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    records = _records.get()
    files: list[str] = []  # the files written, as ``writer.hasten_files``

    class _FileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
            with naming_os_errors(None, path), super().create_stream(path, mode) as raw, naming_os_errors(raw, path, True) as f:
                yield f
            _keep(records, path, f)
            files.append(os.path.abspath(os.fspath(path)))

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)
            old, new = os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(new_path))
            files[:] = [new if f == old else f for f in files]
            if records is not None and old in records:
                records[new] = records.pop(old)

    writer = FileSystemWriter(path, sync_files=sync_files)
    writer.fs = _FileSystem()
    writer.hasten_files = files
    return writer


class _MappedSlice(pyio.RawIOBase):
    """A read-only, seekable file over ``view`` (an item's bytes in an ``mmap`` of its file), for
    ``torch.load``: its reads are copies out of the page cache, without a system call."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._view.release()
        super().close()


def dcp_reader(
    path: str, check: Callable[[str, list[tuple[int, int]] | None], dict[tuple[int, int], str] | None], where: str = "the checkpoint"
) -> Any:
    """torch.distributed.checkpoint's ``FileSystemReader`` for ``path`` that calls
    ``check(file name, regions)`` (a name relative to ``path``; the ``(offset, length)`` of each
    item this process reads there, None for the whole file) for ``.metadata`` and for each file
    of this process's read plan before reading it: a process verifies only what it reads.

    ``check`` verifies the file itself (or nothing, unverified) and returns None, or returns
    the XXH3-128 digest of each region, and the reader verifies each item's bytes just before
    torch reads them. Every item is read through a read-only ``mmap`` of its file: hashed there
    (no copy, no new memory) and handed to torch as a file over that mapping, so the file is
    read once, and a verified load reads exactly as an unverified one does. A mismatch is a
    ``DamagedCheckpoint`` naming the file and the bytes (``where``: the checkpoint's words in
    the message).

    ``.metadata`` is unpickled through the allow-list of ``unpickle.read_dcp_metadata`` (torch's
    reader would ``pickle.load`` it, running whatever it names), once: call ``read_metadata()``
    before ``dcp.load`` so that a damaged or unsafe file is one clear error of this process
    (inside ``dcp.load`` torch would catch it, log it with its traceback, and try per-rank
    metadata files hasten never writes); ``dcp.load`` then gets the same object. Pass
    ``unpickle.dcp_planner(reader, ...)`` as its planner: it reads non-tensor items through
    torch's allow-list, and names the file this reader is reading."""
    reader = _verifying_reader()(path)
    reader.hasten_check, reader.hasten_where = check, where
    return reader


@functools.cache
def _verifying_reader() -> type:
    """The class of ``dcp_reader``'s readers (made once: it needs torch.distributed.checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Verifying(FileSystemReader):
        hasten_check: Callable[[str, list[tuple[int, int]] | None], dict[tuple[int, int], str] | None]
        hasten_where: str
        # Set by each read_data: the digests to verify per file, the file being read (with its
        # mmap and size), and every mmap it made (closed at its end).
        hasten_digests: dict[str, dict[tuple[int, int], str]]
        hasten_mapped: tuple[Any, Any, int] | None
        hasten_maps: list[Any]
        hasten_reading = ""  # the file of the item being read (for the planner's messages)
        hasten_metadata: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # ``rank`` (torch's fallback to per-rank metadata) reads the one file hasten writes
            if self.hasten_metadata is None:
                self.hasten_check(".metadata", None)
                path, shown = os.path.join(os.fspath(self.path), ".metadata"), f"{os.path.basename(os.fspath(self.path))}/.metadata"
                metadata = unpickle.read_dcp_metadata(path, shown, self.hasten_where)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self.hasten_metadata = metadata
            return self.hasten_metadata

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            if checkpoint_id:
                self.hasten_metadata = None

        def read_data(self, plan: Any, planner: Any) -> Any:
            regions: dict[str, set[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                regions.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
            self.hasten_digests, self.hasten_maps, self.hasten_mapped = {}, [], None
            for name in sorted(regions):
                digests = self.hasten_check(name, sorted(regions[name]))
                if digests is not None:
                    self.hasten_digests[name] = digests
            try:
                return super().read_data(plan, planner)
            finally:
                maps, self.hasten_maps, self.hasten_mapped = self.hasten_maps, [], None
                for mapped in maps:
                    with contextlib.suppress(BufferError, AttributeError):  # a view still held: unmapped when freed
                        mapped.close()

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            self.hasten_reading = sinfo.relative_path
            digests = self.hasten_digests.get(sinfo.relative_path)
            offset, length = int(sinfo.offset), int(sinfo.length)
            if self.hasten_mapped is None or self.hasten_mapped[0] is not file:
                size = os.fstat(file.fileno()).st_size
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                self.hasten_mapped = (file, mapped, size)
                self.hasten_maps.append(mapped)
            _, mapped, size = self.hasten_mapped
            view = memoryview(mapped)[offset : offset + length] if mapped is not None and offset + length <= size else None
            if digests is not None:
                h = hasher()
                if view is not None:
                    h.update(view)
                if view is None or h.hexdigest() != digests[(offset, length)]:
                    raise DamagedCheckpoint(
                        f"{self.hasten_where} is damaged: {os.path.basename(os.fspath(self.path)) + '/' + sinfo.relative_path!r} bytes "
                        f"{offset}-{offset + length} do not match their checksum in the manifest"
                    )
            if view is None:  # past the end (unverified): torch's own reader says what it finds
                return super()._slice_file(file, sinfo)
            return _MappedSlice(view)  # torch reads the bytes (just hashed) from the same mapping

    return _Verifying


def write_json(path: str, obj: Any) -> None:
    write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def verify_file(path: str, rec: dict[str, Any]) -> str | None:
    """None if the file at ``path`` matches its manifest record ``rec`` (its whole-file checksum,
    or each of its parts, which must tile it), else what does not match, for the message
    (``"does not match its checksum"``, ``"bytes 10-20 do not match their checksum"``). A
    record with neither checks nothing here (its size is checked by the caller)."""
    expected = checksum_of(rec)
    if expected is not None:
        algorithm, digest = expected
        return None if record(path, algorithm=algorithm)[algorithm] == digest else "does not match its checksum"
    parts = part_table(rec)
    if parts is None:
        return None if "parts" not in rec else "has a malformed list of parts"
    buf = bytearray(1 << 22)
    with open(path, "rb", buffering=0) as f:
        for offset, length, digest in parts:
            h, left = hasher(), length
            while left and (n := f.readinto(memoryview(buf)[: min(left, len(buf))])):
                h.update(memoryview(buf)[:n])
                left -= n
            if left or h.hexdigest() != digest:
                return f"bytes {offset}-{offset + length} do not match their checksum"
        if f.read(1):
            return "has bytes after its last part"
    return None


def part_table(rec: Any) -> list[tuple[int, int, str]] | None:
    """The parts ``(offset, length, xxh3_128)`` of a manifest record, if it has them and they tile
    the file from byte 0 to its size, one after another; else None (as for the parts of a
    SHA-256 record, which are SHA-256 digests of its small items only)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("parts"), list) or "sha256" in rec:
        return None
    try:
        parts = [(int(o), int(n), str(h)) for o, n, h in rec["parts"]]
    except (TypeError, ValueError):
        return None
    at = 0
    for offset, length, _ in parts:
        if offset != at or length <= 0:
            return None
        at += length
    return parts if at == rec.get("size") else None


def record(path: str, checksum: bool = True, algorithm: str = CHECKSUM) -> dict[str, Any]:
    """A file's size and (with ``checksum``) its checksum (``algorithm``), as the manifest lists them."""
    out: dict[str, Any] = {"size": os.path.getsize(path)}
    if checksum:
        h = hasher(algorithm)
        buf = bytearray(1 << 22)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        out[algorithm] = h.hexdigest()
    return out


def replace_file(path: str, writer: Callable[[Any], None]) -> None:
    """Write ``path`` atomically: a temporary file in the same directory, fsync, rename."""
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
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")
    return os.path.abspath(os.fspath(value))


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


# ---------------------------------------------------------------------- model tensors


def require_safetensors(what: str) -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            f"{what} writes/reads safetensors files, which needs the 'safetensors' package: "
            "pip install 'hasten[checkpoint]' (or pass safe_serialization=False for torch .bin files)"
        ) from None
    return safetensors.torch


def flat_tensors(state_dict: dict[str, Any], where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors can store (contiguous, no shared storage) and the tied names.

    A name whose tensor is the very same view as an earlier one (tied weights) is stored
    once and listed in ``aliases`` (name -> stored name); other views of a shared storage
    are copied.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple[int, str]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{where}: state_dict entry {name!r} is a {type(t).__name__}, not a tensor; safetensors stores "
                "tensors only (pass safe_serialization=False)"
            )
        t = t.detach()
        if t.numel():
            ptr = (t.untyped_storage().data_ptr(), str(t.device))
            key = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in views:
                aliases[name] = views[key]
                continue
            views[key] = name
            if ptr in storages or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            storages.add(ptr)
        tensors[name] = t.cpu()
    return tensors, aliases


def safetensors_payload(tensors: dict[str, torch.Tensor], aliases: dict[str, str], where: str) -> Callable[[Any], None]:
    """A writer of ``tensors`` as one safetensors file whose metadata lists the ``aliases``
    among them (tied names -> stored names), for ``write`` or ``replace_file``."""
    st = require_safetensors(where)
    metadata = {"format": "pt", ALIASES_KEY: json.dumps({a: t for a, t in aliases.items() if t in tensors})}
    return lambda f: f.write(st.save(tensors, metadata=metadata))


def tensor_table(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        k: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        for k, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    }


def write_weights(path: str, state_dict: dict[str, Any], safe: bool, where: str) -> None:
    if safe:
        tensors, aliases = flat_tensors(state_dict, where)
        write(path, safetensors_payload(tensors, aliases, where))
    else:
        write(path, lambda f: torch.save(state_dict, f))


def inside(directory: str, name: Any, where: str) -> str:
    """The path of file ``name`` (as a manifest lists it) in ``directory``; an error if it leaves it."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"{where}: the manifest names the file {name!r}, which is not a relative path inside the checkpoint")
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise ValueError(
            f"{where}: the manifest names the file {name!r}, which lies outside the checkpoint folder; "
            "refusing to read it"
        )
    return path


def read_weights(path: str, weights_only: bool = True) -> dict[str, torch.Tensor]:
    """A model's tensors from a safetensors or torch file; a clear error for anything else (an
    ``UnsafeCheckpoint`` naming what a torch file asks to load beyond torch's allow-list, with
    ``weights_only``: ``weights_only=False`` is for trusted files only, it runs what they name)."""
    try:
        return _read_weights(path, weights_only)
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        kind = "safetensors" if path.endswith(".safetensors") else "torch tensor"
        raise ValueError(
            f"cannot read the model weights {path!r}: it is not a plain {kind} file ({type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0][:200]}); nothing was loaded"
            + (" (a trusted torch file holding other objects needs weights_only=False)" if weights_only and kind != "safetensors" else "")
        ) from e


def _read_weights(path: str, weights_only: bool) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        st = require_safetensors("loading model weights")
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = st.load_file(path, device="cpu")
        for name, target in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
            tensors[name] = tensors[target]
        return tensors
    what = f"cannot read the model weights {path!r}: it is not a plain torch tensor file"
    hint = " (a trusted torch file holding other objects needs weights_only=False)"
    loaded = unpickle.torch_load(path, what, weights_only, hint)
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
        raise TypeError(f"it holds a {type(loaded).__name__}, not a dict of tensors")
    return loaded


def compare_tensors(expected: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], where: str) -> None:
    """A clear error when the model's tensor table (names, shapes) differs from the checkpoint's."""
    missing = [k for k in current if k not in expected]
    unexpected = [k for k in expected if k not in current]
    shapes = [
        f"{k}: checkpoint {expected[k]['shape']} vs model {current[k]['shape']}"
        for k in current
        if k in expected and expected[k]["shape"] != current[k]["shape"]
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"different shapes: {'; '.join(shapes[:5])}{' ...' if len(shapes) > 5 else ''}")
        raise ValueError(f"{where} does not fit the prepared model: " + " | ".join(parts))
