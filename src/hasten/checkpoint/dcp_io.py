"""hasten's glue to ``torch.distributed.checkpoint`` (DCP): its writer and reader, hashing and verifying.

``dcp_writer`` is DCP's ``FileSystemWriter`` (``FsspecWriter`` for a URL) whose files are hashed
as they are written (each item of a file on its own: the manifest's "parts") and whose OS
failures name their file; ``dcp_reader`` is DCP's ``FileSystemReader`` (``FsspecReader`` for a
URL) that verifies each item it reads as it reads it, and unpickles ``.metadata`` only through
``unpickle``'s allow-list. ``dcp()`` is the module,
without its warning that one process without a group is one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io as pyio
import math
import mmap
import os
import warnings
from collections.abc import Callable
from typing import Any

from hasten.checkpoint import files, storage, unpickle, uploads
from hasten.checkpoint.checksums import hasher
from hasten.checkpoint.errors import DamagedCheckpoint

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


def dcp() -> Any:
    """``torch.distributed.checkpoint``, without its warning that one process without a group is
    one process (``quiet_dcp``: a filter added once, not ``warnings.catch_warnings`` around
    each call, which would reset the registry of once-only warnings at every save and load)."""
    import torch.distributed.checkpoint as dcp

    quiet_dcp()
    return dcp


def no_dist() -> bool:
    """One process without a process group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


# Object stores, whose "folders" are key prefixes: nothing to make before writing into one.
_FOLDERLESS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


@contextlib.contextmanager
def _uploaded(fs: Any, path: str, in_place: dict[str, str], records: Any, written: list[str]) -> Any:
    """A file of ``dcp_writer`` at a URL, hashed as it is written into memory and uploaded at its
    end (``uploads.Upload``; nothing where it fails); DCP's ``.metadata.tmp`` is written as
    ``.metadata`` (recorded in ``in_place``). Its record goes into ``records``, its path into ``written``."""
    if path.rsplit("/", 1)[-1].endswith(".metadata.tmp"):
        path = in_place.setdefault(path, path[: -len(".tmp")])
    upload = uploads.Upload(fs, path)
    try:
        with files.naming_os_errors(None, path), files.naming_os_errors(upload, path, True) as f:
            yield f
            upload.close()
    except BaseException:
        upload.discard()
        raise
    files.keep_record(records, path, f)
    written.append(storage.key(path))


def dcp_writer(path: str, sync_files: bool = True) -> Any:
    """torch.distributed.checkpoint's ``FileSystemWriter`` for ``path`` whose OS failures name
    their file, and which records the size and checksum of each file (and of each item in it) it writes (into the
    ``recording()`` active where it is made) as it writes it. ``writer.hasten_files``: the files
    it wrote (``.metadata`` on the coordinating process); with ``sync_files=False`` they are
    left unsynced, for the caller to ``fsync_files`` once everything is written. Each process's
    items are written smallest first (``_small_first``).

    At a URL it is DCP's ``FsspecWriter`` with what an object store makes slow left out: each file
    is written into memory and sent in one ``fs.pipe_file`` (``uploads.Upload``), ``.metadata`` is
    uploaded in place (an object appears whole or not at all; DCP's ``.metadata.tmp`` and rename
    would be an upload, a server-side copy and a delete, with listings to find them), no folder is
    made in an object store (``_FOLDERLESS``), and no probe asks whether ``.metadata`` exists (torch
    asks only to warn that it overwrites). Nothing is synced."""
    url = storage.is_url(path)
    if url:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as Writer
    else:
        from torch.distributed.checkpoint import FileSystemWriter as Writer
        from torch.distributed.checkpoint.filesystem import FileSystem

    records = files.active_records()
    written: list[str] = []  # the files written, as ``writer.hasten_files``
    folderless = url and storage.protocol_of(path) in _FOLDERLESS

    class _FileSystem(FileSystem):
        # at a URL: DCP's temporary names of files written in place -> their names
        in_place: dict[str, str]

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
            if url and "w" in mode:
                with _uploaded(self.fs, os.fspath(path), self.in_place, records, written) as f:
                    yield f
                return
            with (
                files.naming_os_errors(None, path),
                super().create_stream(path, mode) as raw,
                files.naming_os_errors(raw, path, True) as f,
            ):
                yield f
            files.keep_record(records, path, f)
            written.append(storage.key(path))

        def exists(self, path: str | os.PathLike) -> bool:
            if url and os.fspath(path) in self.in_place.values():
                return False  # written in place just now: no earlier copy to delete first
            return super().exists(path)

        def mkdir(self, path: str | os.PathLike) -> None:
            if not folderless:
                super().mkdir(path)

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            if url and self.in_place.get(os.fspath(path)) == os.fspath(new_path):
                return  # uploaded at ``new_path`` already
            super().rename(path, new_path)
            old, new = storage.key(path), storage.key(new_path)
            written[:] = [new if f == old else f for f in written]
            if records is not None and old in records:
                records[new] = records.pop(old)

    class _Writer(Writer):
        def _metadata_exists(self) -> bool:
            # torch asks only to warn that it overwrites (hasten's writers overwrite): no request for it at a URL
            return False if url else super()._metadata_exists()

        def write_data(self, plan: Any, planner: Any) -> Any:
            # the small items first (``_small_first``): what another process reads of this file is one short range
            return super().write_data(dataclasses.replace(plan, items=_small_first(plan.items)), planner)

    writer = _Writer(path, sync_files=sync_files and not url)
    fs = _FileSystem()
    fs.in_place = {}
    if url:
        fs.fs = writer.fs.fs  # the fsspec filesystem of the URL (its configuration: fsspec's own)
    writer.fs = fs
    writer.hasten_files = written
    return writer


def _small_first(items: list[Any]) -> list[Any]:
    """A process's write items, the smallest first (stable: else in plan order). DCP stores an item
    that every process holds whole (an optimizer's ``step``, its ``param_groups``) once, in one
    process's file, among its shards: in plan order they lie scattered through that file, and a
    process reading them at a URL fetched that whole file (bench row 16: a second copy of the
    optimizer's bytes); the small ones first, they are one short range at its start."""

    def size(item: Any) -> int:
        data = item.tensor_data
        return 0 if data is None else math.prod(data.chunk.sizes) * data.properties.dtype.itemsize

    return sorted(items, key=size)


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
    path: str,
    check: Callable[[str, list[tuple[int, int]] | None], dict[tuple[int, int], str] | None],
    where: str = "the checkpoint",
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
    reader = _verifying_reader(storage.is_url(path))(path)
    reader.hasten_check, reader.hasten_where, reader.hasten_listed = check, where, {}
    return reader


def _check_slice(view: Any, digest: str, where: str, shown: str, offset: int, length: int) -> None:
    """Raise DamagedCheckpoint unless the bytes ``view`` (None: past the file's end) hash to ``digest``."""
    h = hasher()
    if view is not None:
        h.update(view)
    if view is None or h.hexdigest() != digest:
        raise DamagedCheckpoint(
            f"{where} is damaged: {shown!r} bytes {offset}-{offset + length} "
            "do not match their checksum in the manifest"
        )


def _reader_base(url: bool) -> type:
    """DCP's reader that ``dcp_reader``'s class extends: ``FsspecReader`` for a URL, else ``FileSystemReader``."""
    if url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class _Named:
    """torch's ``FileSystem`` of a reader at a URL, during ``read_data``: ``create_stream`` opens
    nothing (no request: the reads come from ``storage.Ranges``) and hands on the file's URL."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        yield os.fspath(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _checked(reader: Any, plan: Any) -> dict[str, dict[tuple[int, int], str]]:
    """``reader.hasten_check`` of each file ``plan`` reads, with the regions it reads there (at a
    URL one listing of the folder for all of them): the digests to verify, by file."""
    regions: dict[str, set[tuple[int, int]]] = {}
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        regions.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
    out = {}
    with storage.remembering(reader.hasten_listed):
        for name in sorted(regions):
            digests = reader.hasten_check(name, sorted(regions[name]))
            if digests is not None:
                out[name] = digests
    return out


def _url_of(reader: Any, relative_path: str) -> str:
    return os.fspath(reader.fs.concat_path(reader.path, relative_path))


def _in_order(reader: Any, plan: Any) -> tuple[Any, list[tuple[str, int, int]]]:
    """``plan`` of a reader at a URL with its items in file and offset order (each is read on its
    own: the order is free), and the ranges ``(url, offset, length)`` they read, in that order."""
    order: dict[str, int] = {}
    for item in plan.items:
        order.setdefault(reader.storage_data[item.storage_index].relative_path, len(order))

    def where(item: Any) -> tuple[int, int]:
        info = reader.storage_data[item.storage_index]
        return order[info.relative_path], int(info.offset)

    plan = dataclasses.replace(plan, items=sorted(plan.items, key=where))
    infos = [reader.storage_data[item.storage_index] for item in plan.items]
    return plan, [(_url_of(reader, i.relative_path), int(i.offset), int(i.length)) for i in infos]


def _ranged(reader: Any, plan: Any) -> tuple[Any, storage.Ranges]:
    """``plan`` in file and offset order (``_in_order``) and its ranges, being fetched
    (``storage.Ranges``): those ``prepare_local_plan`` began to fetch where they are the same."""
    plan, wanted = _in_order(reader, plan)
    early = reader.hasten_early
    if early is not None and early[0] == wanted:
        reader.hasten_early = None
        return plan, early[1]
    _drop_early(reader)
    return plan, storage.Ranges(reader.fs.fs, wanted)


def _url_slice(reader: Any, sinfo: Any, digests: dict[tuple[int, int], str] | None) -> Any:
    """An item of a file at a URL for torch: its bytes from ``reader.hasten_ranges``, verified
    against ``digests`` where given; empty where the file ends before them (torch says what it finds)."""
    offset, length = int(sinfo.offset), int(sinfo.length)
    view = reader.hasten_ranges.take(_url_of(reader, sinfo.relative_path), offset, length)
    if digests is not None:
        shown = f"{os.path.basename(os.fspath(reader.path))}/{sinfo.relative_path}"
        _check_slice(view, digests[(offset, length)], reader.hasten_where, shown, offset, length)
    return pyio.BytesIO(b"") if view is None else _MappedSlice(view)


def _read_metadata(reader: Any) -> Any:
    """The reader's ``.metadata``, checked (``hasten_check``) then unpickled through the allow-list."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    with storage.remembering(reader.hasten_listed):
        reader.hasten_check(".metadata", None)
    path = os.path.join(os.fspath(reader.path), ".metadata")
    shown = f"{os.path.basename(os.fspath(reader.path))}/.metadata"
    metadata = unpickle.read_dcp_metadata(path, shown, reader.hasten_where)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def _fetch_early(reader: Any, plan: Any) -> None:
    """At a URL, from ``prepare_local_plan``: this process's reads begin now, while the processes
    agree on the plan (``_ranged`` takes them where the plan read is the same)."""
    _drop_early(reader)
    _, wanted = _in_order(reader, plan)
    reader.hasten_early = (wanted, storage.Ranges(reader.fs.fs, wanted))


def _drop_early(reader: Any) -> None:
    early, reader.hasten_early = reader.hasten_early, None
    if early is not None:
        early[1].close()


def _mapping(reader: Any, file: Any) -> tuple[Any, Any, int]:
    """``(file, read-only mmap of it (None where it is empty), its size)``, made once per file a
    ``read_data`` reads (``reader.hasten_maps``: closed at its end)."""
    if reader.hasten_mapped is None or reader.hasten_mapped[0] is not file:
        size = os.fstat(file.fileno()).st_size
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        reader.hasten_mapped = (file, mapped, size)
        reader.hasten_maps.append(mapped)
    return reader.hasten_mapped


@functools.cache
def _verifying_reader(url: bool) -> type:
    """The class of ``dcp_reader``'s readers (made once: it needs torch.distributed.checkpoint):
    over ``FsspecReader`` for a URL (``url``), else ``FileSystemReader``."""

    class _Verifying(_reader_base(url)):
        hasten_check: Callable[[str, list[tuple[int, int]] | None], dict[tuple[int, int], str] | None]
        hasten_where: str
        # Set by each read_data: the digests to verify per file, the file being read (with its
        # mmap and size), and every mmap it made (closed at its end).
        hasten_digests: dict[str, dict[tuple[int, int], str]]
        hasten_mapped: tuple[Any, Any, int] | None
        hasten_maps: list[Any]
        hasten_ranges: Any = None  # at a URL, during read_data: the bytes its items read
        hasten_early: Any = None  # at a URL, from prepare_local_plan to read_data: (regions, their Ranges)
        hasten_listed: dict[str, dict[str, int]]  # at a URL: the folder as its checks listed it (this reader's)
        hasten_reading = ""  # the file of the item being read (for the planner's messages)
        hasten_metadata: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # ``rank`` (torch's fallback to per-rank metadata) reads the one file hasten writes
            if self.hasten_metadata is None:
                self.hasten_metadata = _read_metadata(self)
            return self.hasten_metadata

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            _drop_early(self)
            if checkpoint_id:
                self.hasten_metadata, self.hasten_listed = None, {}

        def prepare_local_plan(self, plan: Any) -> Any:
            plan = super().prepare_local_plan(plan)
            if url:
                _fetch_early(self, plan)
            return plan

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                self.hasten_digests, self.hasten_maps, self.hasten_mapped = _checked(self, plan), [], None
            except BaseException:
                _drop_early(self)
                raise
            if url:  # the items in file and offset order, fetched ahead; torch's FileSystem opens nothing
                plan, self.hasten_ranges = _ranged(self, plan)
                fs, self.fs = self.fs, _Named(self.fs)
            try:
                return super().read_data(plan, planner)
            finally:
                if url:
                    self.fs, ranges, self.hasten_ranges = fs, self.hasten_ranges, None
                    ranges.close()
                maps, self.hasten_maps, self.hasten_mapped = self.hasten_maps, [], None
                for mapped in maps:
                    with contextlib.suppress(BufferError, AttributeError):  # a view still held: unmapped when freed
                        mapped.close()

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            self.hasten_reading = sinfo.relative_path
            digests = self.hasten_digests.get(sinfo.relative_path)
            offset, length = int(sinfo.offset), int(sinfo.length)
            if url:
                return _url_slice(self, sinfo, digests)
            _, mapped, size = _mapping(self, file)
            view = (
                memoryview(mapped)[offset : offset + length] if mapped is not None and offset + length <= size else None
            )
            if digests is not None:
                shown = f"{os.path.basename(os.fspath(self.path))}/{sinfo.relative_path}"
                _check_slice(view, digests[(offset, length)], self.hasten_where, shown, offset, length)
            if view is None:  # past the end (unverified): torch's own reader says what it finds
                return super()._slice_file(file, sinfo)
            return _MappedSlice(view)  # torch reads the bytes (just hashed) from the same mapping

    return _Verifying
