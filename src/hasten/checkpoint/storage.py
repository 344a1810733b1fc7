"""Where checkpoint files live: the local disk or an fsspec URL, chosen once per path (``of``).

``LocalStorage`` is the operating system's files: writes are fsynced and folders renamed into
place (``files``, ``commit``). ``FsspecStorage`` is any fsspec filesystem named by a URL
(``s3://``, ``gs://``, ``az://``, ``memory://`` ...): an object store has no rename, no fsync and
no lock, so a save writes every file into the checkpoint's folder and the manifest last, and a
folder without its manifest is never loaded (``commit``). Both answer the same questions (is
there a file, its size, the names in a folder, open a file), and the module-level functions
(``open``, ``isfile``, ``getsize`` ...) ask the storage of the path they are given, so a reader
needs no branch of its own: a local path goes straight to ``os`` as before.

At a URL a save's large files are written into memory and sent in one ``fs.pipe_file``
(``Upload``: one request, or s3fs's concurrent multipart upload), and a load's reads are ranged
requests fetched ahead and concurrently (``Ranges``), neighbouring items sharing one. Inside
``remembering()`` (a load's read step) a folder is listed once, and a small file is downloaded
once: its checksum verified on those bytes, then read from them (``keep``).

fsspec's own configuration gives the credentials and endpoints (``FSSPEC_S3_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``~/.config/fsspec/*.json``); hasten has no setting of its own for them.
fsspec is imported only when a URL is used (``import hasten`` never imports it).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import io
import os
import posixpath
import shutil
from collections.abc import Iterator
from typing import Any

from hasten.checkpoint.uploads import UPLOAD_BUFFER, Upload, later  # noqa: F401 - a save's uploads, named here too
from hasten.settings.locations import check_location, is_url, protocol_of

__all__ = ["FsspecStorage", "LocalStorage", "check_location", "is_url", "of", "remembering"]


class LocalStorage:
    """The local disk: ``os`` and ``shutil`` (renames, fsync and locks are ``files``/``commit``/``naming``'s)."""

    url = False

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def getsize(self, path: str) -> int:
        return os.path.getsize(path)

    def listdir(self, path: str) -> dict[str, bool]:
        """``{name: is a folder}`` of the entries of ``path``; empty where it is no folder."""
        if not os.path.isdir(path):
            return {}
        return {e: os.path.isdir(os.path.join(path, e)) for e in os.listdir(path)}

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        return builtins.open(path, mode, **kwargs)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        os.remove(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class FsspecStorage:
    """An fsspec filesystem, addressed by full URLs. Every question about what exists asks the
    store again (fsspec's listing cache is dropped first): other processes write there too."""

    url = True

    def _fs(self, path: str) -> tuple[Any, str]:
        from fsspec.core import url_to_fs

        return url_to_fs(path)

    def _fresh(self, path: str) -> tuple[Any, str]:
        fs, p = self._fs(path)
        fs.invalidate_cache()
        return fs, p

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base, *names)

    def exists(self, path: str) -> bool:
        fs, p = self._fresh(path)
        return bool(fs.exists(p))

    def isfile(self, path: str) -> bool:
        fs, p = self._fresh(path)
        return bool(fs.isfile(p))

    def isdir(self, path: str) -> bool:
        fs, p = self._fresh(path)
        return bool(fs.isdir(p))

    def getsize(self, path: str) -> int:
        fs, p = self._fresh(path)
        return int(fs.size(p))

    def listdir(self, path: str) -> dict[str, bool]:
        """``{name: is a folder (a prefix)}`` of the entries of ``path``; empty where there are none."""
        fs, p = self._fresh(path)
        try:
            found = fs.ls(p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for entry in found:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if name and str(entry["name"]).rstrip("/") != p.rstrip("/"):
                out[name] = entry.get("type") == "directory"
        return out

    def sizes(self, path: str) -> dict[str, int]:
        """``{name relative to path: size}`` of every file under ``path``, in one listing (inside
        ``remembering()``, the first listing of ``path`` there)."""
        known = _remembered.get()
        if known is not None and path in known:
            return dict(known[path])
        ahead = _ahead.get()
        listing = None if ahead is None else ahead.listings.pop(path, None)
        found = self._sizes(path) if listing is None else listing.result()
        if known is not None:
            known[path] = dict(found)
        return found

    def _sizes(self, path: str, start: str = "") -> dict[str, int]:
        """``sizes`` from the store; on S3, of the names that begin with ``start`` only."""
        fs, p = self._fresh(path)
        root = p.rstrip("/") + "/"
        try:
            if _s3(fs) and ("/" in p.rstrip("/") or start):
                # one ListObjectsV2 of the prefix: s3fs's ``find(p)`` of an empty prefix (a new folder) asks
                # twice more whether ``p`` is a file (a HEAD and a listing), which a folder never is
                parent, _, name = p.rstrip("/").rpartition("/")
                found = fs.find(parent or p, detail=True, prefix=f"{name}/{start}" if parent else start)
            else:
                found = fs.find(p, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(name)[len(root) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if str(name).startswith(root) and info.get("type") != "directory"
        }

    def files_starting(self, path: str, start: str) -> list[str]:
        """The names of the objects directly in ``path`` that begin with ``start``, sorted (on S3 one
        listing of that prefix, whatever else the folder holds; elsewhere the folder's listing)."""
        if _s3(self._fs(path)[0]):
            return sorted(n for n in self._sizes(path, start) if "/" not in n and n.startswith(start))
        return sorted(n for n, folder in self.listdir(path).items() if not folder and n.startswith(start))

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        fs, p = self._fs(path)
        return fs.open(p, mode, **kwargs)

    def makedirs(self, path: str) -> None:
        fs, p = self._fs(path)
        fs.makedirs(p, exist_ok=True)

    def remove(self, path: str) -> None:
        fs, p = self._fs(path)
        fs.rm_file(p)

    def remove_all(self, path: str, names: list[str]) -> None:
        """The objects ``path/name`` of ``names`` (relative names, as ``sizes`` gives them), in one
        request where the store deletes several at once (s3fs: DeleteObjects); no listing."""
        if not names:
            return
        fs, p = self._fs(path)
        root = p.rstrip("/")
        try:
            fs.rm([f"{root}/{name}" for name in names])
        except FileNotFoundError:
            pass
        fs.invalidate_cache()

    def rmtree(self, path: str) -> None:
        """Every object under ``path`` (nothing where there is none)."""
        fs, p = self._fresh(path)
        try:
            fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache()


def _s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's (whose ``find`` takes a ``prefix`` that the store filters)."""
    return type(fs).__module__.partition(".")[0] == "s3fs"


# Inside ``remembering()``: the listings ``FsspecStorage.sizes`` made there, by folder, and the
# small files at a URL read whole there (``keep``), by URL.
_remembered: contextvars.ContextVar[dict[str, dict[str, int]] | None] = contextvars.ContextVar(
    "hasten_remembered_listings", default=None
)
_kept: contextvars.ContextVar[dict[str, bytes] | None] = contextvars.ContextVar("hasten_kept_files", default=None)


class _Ahead:
    """Inside ``remembering()``: the listings and whole files at URLs that ``fetch_ahead`` began to
    fetch, on a few threads of their own, for ``FsspecStorage.sizes`` and ``read_bytes`` to take."""

    def __init__(self) -> None:
        self.listings: dict[str, Any] = {}
        self.files: dict[str, Any] = {}
        self.pool: Any = None
        self.held = 0  # the bytes of the files fetched ahead

    def submit(self, fn: Any, *args: Any) -> Any:
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(4, thread_name_prefix="hasten-ahead")
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        if self.pool is not None:  # what was not taken is dropped; a request under way ends by itself
            self.pool.shutdown(wait=False, cancel_futures=True)


_ahead: contextvars.ContextVar[_Ahead | None] = contextvars.ContextVar("hasten_fetched_ahead", default=None)

# The largest file at a URL read whole in one request to be verified (``checksums``) and kept for
# its reader (``keep``), and the most bytes kept at once in one ``remembering()``.
KEEP_FILE = 1 << 25
KEEP_TOTAL = 1 << 27


@contextlib.contextmanager
def remembering(known: dict[str, dict[str, int]] | None = None) -> Iterator[None]:
    """Within: ``FsspecStorage.sizes`` lists a folder once and answers again from that listing,
    and a small file at a URL read whole once (``keep``: the bytes its checksum was verified on) is
    read from those bytes again (``read_bytes``, ``open``), for one step that asks about the same
    files several times (a load's checks of each file it reads and its reads, while nothing writes
    there); ``known``: the listings of an earlier such step of the same reader, kept in (and added
    to). Outside, every question asks the store again."""
    if _remembered.get() is not None:
        yield
        return
    token = _remembered.set({} if known is None else known)
    kept, ahead = _kept.set({}), _ahead.set(_Ahead())
    try:
        yield
    finally:
        _ahead.get().close()  # type: ignore[union-attr]
        _ahead.reset(ahead)
        _kept.reset(kept)
        _remembered.reset(token)


def fetch_ahead(files: dict[str, int] | None = None, listing: str | None = None) -> None:
    """Inside ``remembering()``: begin to fetch, concurrently, the listing of the folder at the URL
    ``listing`` and the whole files at the URLs of ``files`` (``{url: size}``; those of at most
    ``KEEP_FILE`` bytes, ``KEEP_TOTAL`` in all) that this step is about to read, each in one request:
    ``sizes`` and ``read_bytes`` take what was fetched (once), as the bytes they would have asked for.
    Nothing outside, or for a path that is no URL."""
    ahead = _ahead.get()
    if ahead is None:
        return
    known = _remembered.get() or {}
    if listing is not None and is_url(listing) and listing not in known and listing not in ahead.listings:
        ahead.listings[listing] = ahead.submit(_FSSPEC._sizes, listing)
    for path, size in (files or {}).items():
        if is_url(path) and path not in ahead.files and _kept_bytes(path) is None and 0 <= size <= KEEP_FILE:
            if ahead.held + size <= KEEP_TOTAL:
                ahead.files[path], ahead.held = ahead.submit(_read_url, path), ahead.held + size


def keep(path: str, data: bytes) -> None:
    """Inside ``remembering()``: the bytes of the file at the URL ``path`` (just read whole and
    verified), for its next read there; nothing outside, or past ``KEEP_FILE``/``KEEP_TOTAL``."""
    kept = _kept.get()
    if kept is None or not is_url(path) or len(data) > KEEP_FILE:
        return
    if sum(map(len, kept.values())) - len(kept.get(path, b"")) + len(data) <= KEEP_TOTAL:
        kept[path] = data


def _kept_bytes(path: str) -> bytes | None:
    kept = _kept.get()
    return None if kept is None else kept.get(path)


LOCAL = LocalStorage()
_FSSPEC = FsspecStorage()


def of(path: str) -> LocalStorage | FsspecStorage:
    """The storage of ``path``: ``FsspecStorage`` for a URL (``settings.locations.is_url``), else the local disk."""
    return _FSSPEC if is_url(path) else LOCAL


def key(path: str | os.PathLike) -> str:
    """``path`` as records are keyed: a URL as it is, a local path made absolute."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


def describe(path: str) -> str:
    """The storage of ``path`` in a message's words."""
    return f"the {protocol_of(path)}:// object store" if is_url(path) else "the local disk"


# The questions readers ask, of whichever storage holds the path.
def open(path: str, mode: str = "rb", **kwargs: Any) -> Any:  # noqa: A001 - the builtin's name, on purpose
    """``path`` opened; a file at a URL that ``remembering()`` kept is read from its bytes (no request)."""
    data = _kept_bytes(path) if mode == "rb" else None
    if data is not None:
        return io.BytesIO(data)
    return of(path).open(path, mode, **kwargs)


def exists(path: str) -> bool:
    return of(path).exists(path)


def isfile(path: str) -> bool:
    return of(path).isfile(path)


def isdir(path: str) -> bool:
    return of(path).isdir(path)


def getsize(path: str) -> int:
    data = _kept_bytes(path)
    return of(path).getsize(path) if data is None else len(data)


# What one read of a URL fetches beyond the bytes asked for, which the next read in file order takes.
RANGE_READAHEAD = 1 << 20


def open_ranges(path: str) -> Any:
    """``path`` opened for seeks and reads of byte ranges (``slices``), never a download of the
    whole file: a local file unbuffered (only the bytes asked for are read); an object at a URL
    with fsspec's read-ahead cache, each read one ranged request for the bytes asked for plus
    ``RANGE_READAHEAD`` (so reads in file order of small tensors share a request); a file that
    ``remembering()`` kept, from its bytes."""
    data = _kept_bytes(path)
    if data is not None:
        return io.BytesIO(data)
    if is_url(path):
        return _FSSPEC.open(path, "rb", block_size=RANGE_READAHEAD, cache_type="readahead")
    return builtins.open(path, "rb", buffering=0)


def read_bytes(path: str) -> bytes:
    """The whole file at ``path``: at a URL one request (``open`` would ask for the size first; a
    missing object is FileNotFoundError), none where ``remembering()`` kept it."""
    if is_url(path):
        data = _kept_bytes(path)
        if data is not None:
            return data
        ahead = _ahead.get()
        fetched = None if ahead is None else ahead.files.pop(path, None)
        return _read_url(path) if fetched is None else fetched.result()
    with open(path, "rb") as f:
        return bytes(f.read())


def _read_url(path: str) -> bytes:
    fs, p = _FSSPEC._fs(path)
    return bytes(fs.cat_file(p, start=0))


# At a URL, a load's reads: ranged requests of at most RANGE_CHUNK bytes, up to RANGE_FETCHES at
# once, at most RANGE_AHEAD bytes fetched and not yet read. Items of a file at most RANGE_GAP bytes
# apart share one request, the bytes between fetched too: a request costs about as much as that many
# bytes more of a body (its latency on a real store; on a one-process server such as moto, which
# reads the whole object for each ranged request, far more), and a process reads items scattered
# through another's file (the replicated ones DCP stored once, such as AdamW's ``step``).
RANGE_CHUNK = 1 << 25
RANGE_GAP = 1 << 24
RANGE_FETCHES = 8
RANGE_AHEAD = 1 << 28


class Ranges:
    """The byte ranges a load reads from files at a URL, fetched ahead, concurrently, in the order
    they are read: ``regions`` is ``[(url, offset, length)]`` in that order. Items of a file at
    most ``RANGE_GAP`` bytes apart share a ranged request (``fs.cat_file(url, start, end)``: no
    request to learn a size), a large item is fetched as several. ``take`` hands out an item's
    bytes (a view, no copy), waiting only for its own requests; the bytes of a request are
    dropped once every item in it was taken."""

    def __init__(self, fs: Any, regions: list[tuple[str, int, int]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.fs = fs
        self.requests: list[list[Any]] = []  # [url, start, end, items left, future]
        self.where: dict[tuple[str, int, int], list[int]] = {}  # item -> its requests
        self.left: dict[tuple[str, int, int], int] = {}  # item -> how many times it is still to be taken
        for url, offset, length in regions:
            if (url, offset, length) in self.left:
                self.left[(url, offset, length)] += 1
                continue
            self.left[(url, offset, length)] = 1
            last = self.requests[-1] if self.requests else None
            if (
                last is not None
                and last[0] == url
                and last[1] <= offset <= last[2] + RANGE_GAP
                and offset + length - last[1] <= RANGE_CHUNK
            ):
                last[2], last[3] = max(last[2], offset + length), last[3] + 1
                self.where[(url, offset, length)] = [len(self.requests) - 1]
                continue
            spans = range(offset, offset + max(length, 1), RANGE_CHUNK)
            self.where[(url, offset, length)] = list(range(len(self.requests), len(self.requests) + len(spans)))
            self.requests += [[url, s, min(s + RANGE_CHUNK, offset + length), 1, None] for s in spans]
        self.pool = ThreadPoolExecutor(RANGE_FETCHES, thread_name_prefix="hasten-ranges")
        self.sent = 0  # the requests sent so far (in order)
        self.ahead = 0  # bytes of the requests sent and not yet dropped
        self._send(0)

    def _send(self, upto: int) -> None:
        """Send the next requests in order: every one up to ``upto``, then more while fewer than
        ``RANGE_AHEAD`` bytes are ahead."""
        while self.sent < len(self.requests):
            req = self.requests[self.sent]
            size = req[2] - req[1]
            if self.sent > upto and self.ahead + size > RANGE_AHEAD:
                return
            req[4] = self.pool.submit(self.fs.cat_file, req[0], start=req[1], end=req[2])
            self.ahead += size
            self.sent += 1

    def take(self, url: str, offset: int, length: int) -> memoryview | None:
        """The bytes of an item (one of ``regions``); None where the file ends before them. A
        failed request raises its error."""
        ids = self.where[(url, offset, length)]
        self._send(ids[-1])
        try:
            parts = [self.requests[i][4].result() for i in ids]
        finally:
            self.left[(url, offset, length)] -= 1
            if self.left[(url, offset, length)] == 0:
                for i in ids:
                    self._taken(i)
        if len(ids) == 1:
            start = self.requests[ids[0]][1]
            view = memoryview(parts[0])[offset - start : offset - start + length]
        else:
            view = memoryview(b"".join(parts))[:length]  # its last request may hold a neighbour too
        return view if view.nbytes == length else None

    def _taken(self, i: int) -> None:
        req = self.requests[i]
        req[3] -= 1
        if req[3] == 0 and req[4] is not None:
            req[4] = _Dropped  # its bytes go once the items handed out are freed
            self.ahead -= req[2] - req[1]

    def close(self) -> None:
        for req in self.requests:
            if req[4] is not None and req[4] is not _Dropped:
                req[4].cancel()
        self.pool.shutdown(wait=True)


class _DroppedFuture:
    def result(self) -> Any:  # pragma: no cover - every item is taken once
        raise RuntimeError("a range was read twice")

    def cancel(self) -> bool:
        return False


_Dropped = _DroppedFuture()
