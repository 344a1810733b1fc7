"""Where checkpoint files live: the local disk or an fsspec URL, chosen once per path (``of``).

``LocalStorage`` is the operating system's files: writes are fsynced and folders renamed into
place (``files``, ``commit``). ``FsspecStorage`` is any fsspec filesystem named by a URL
(``s3://``, ``gs://``, ``az://``, ``memory://`` ...): an object store has no rename, no fsync and
no lock, so a save writes every file into the checkpoint's folder and the manifest last, and a
folder without its manifest is never loaded (``commit``). Both answer the same questions (is
there a file, its size, the names in a folder, open a file), and the module-level functions
(``open``, ``isfile``, ``getsize`` ...) ask the storage of the path they are given, so a reader
needs no branch of its own: a local path goes straight to ``os`` as before.

fsspec's own configuration gives the credentials and endpoints (``FSSPEC_S3_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``~/.config/fsspec/*.json``); hasten has no setting of its own for them.
fsspec is imported only when a URL is used (``import hasten`` never imports it).
"""

from __future__ import annotations

import builtins
import os
import posixpath
import shutil
from typing import Any

from hasten.settings.locations import check_location, is_url, protocol_of

__all__ = ["FsspecStorage", "LocalStorage", "check_location", "is_url", "of"]


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
        """``{name relative to path: size}`` of every file under ``path``, in one listing."""
        fs, p = self._fresh(path)
        try:
            found = fs.find(p, detail=True)
        except FileNotFoundError:
            return {}
        root = p.rstrip("/") + "/"
        return {
            str(name)[len(root) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if str(name).startswith(root) and info.get("type") != "directory"
        }

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        fs, p = self._fs(path)
        return fs.open(p, mode, **kwargs)

    def makedirs(self, path: str) -> None:
        fs, p = self._fs(path)
        fs.makedirs(p, exist_ok=True)

    def remove(self, path: str) -> None:
        fs, p = self._fs(path)
        fs.rm_file(p)

    def rmtree(self, path: str) -> None:
        """Every object under ``path`` (nothing where there is none)."""
        fs, p = self._fresh(path)
        try:
            fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache()


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
    return of(path).open(path, mode, **kwargs)


def exists(path: str) -> bool:
    return of(path).exists(path)


def isfile(path: str) -> bool:
    return of(path).isfile(path)


def isdir(path: str) -> bool:
    return of(path).isdir(path)


def getsize(path: str) -> int:
    return of(path).getsize(path)


# What one read of a URL fetches beyond the bytes asked for, which the next read in file order takes.
RANGE_READAHEAD = 1 << 20


def open_ranges(path: str) -> Any:
    """``path`` opened for seeks and reads of byte ranges (``slices``), never a download of the
    whole file: a local file unbuffered (only the bytes asked for are read); an object at a URL
    with fsspec's read-ahead cache, each read one ranged request for the bytes asked for plus
    ``RANGE_READAHEAD`` (so reads in file order of small tensors share a request)."""
    if is_url(path):
        return _FSSPEC.open(path, "rb", block_size=RANGE_READAHEAD, cache_type="readahead")
    return builtins.open(path, "rb", buffering=0)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return bytes(f.read())
