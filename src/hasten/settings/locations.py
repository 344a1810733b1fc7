"""Where a run's files can live: a local path, or a URL of any installed fsspec protocol.

A string that looks like a URL (``s3://bucket/run``, ``gs://...``, ``memory://x``,
``simplecache::s3://...``) is a URL, never a local path: its protocol is checked where the value
enters (``check_location``), and one whose package is not installed is refused there, naming
that package, before anything is written. ``file://`` is the local disk (``local_path``).
Credentials and endpoints are fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``,
``AWS_*``, ``~/.config/fsspec``), never a setting of hasten's. fsspec is imported only
for a URL.
"""

from __future__ import annotations

import os
import re
from typing import Any

# scheme "://" (RFC 3986's letters), or fsspec's chaining "proto::"; a Windows drive ("C:\\") is no URL
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


def is_url(path: Any) -> bool:
    """Whether ``path`` (a str or os.PathLike) is a URL (``scheme://`` or fsspec's ``scheme::``)."""
    return isinstance(path, str) and _URL.match(path) is not None


def protocol_of(url: str) -> str:
    """The first protocol of ``url`` (``"s3"`` for ``s3://b/k``, ``"simplecache"`` for a chained one)."""
    match = _URL.match(url)
    assert match is not None, url
    return match.group(1).lower()


def local_path(url: str) -> str | None:
    """The local path a ``file://`` URL names (``file:///tmp/x`` -> ``/tmp/x``); None for any other URL."""
    if protocol_of(url) == "file" and url[4:7] == "://":
        rest = url[len("file://") :]
        return rest[len("localhost") :] if rest.startswith("localhost/") else rest
    return None


def check_protocol(owner: str, field: str, url: str) -> None:
    """The fsspec implementation of every protocol of ``url`` is installed; else an ImportError
    naming the package to install (``pip install s3fs``), or a ValueError for a protocol fsspec
    does not know."""
    try:
        from fsspec.registry import get_filesystem_class, known_implementations
    except ImportError:  # pragma: no cover - torch depends on fsspec
        raise ImportError(
            f"{owner}.{field}={url!r} is a URL, which hasten reads and writes through fsspec: pip install fsspec"
        ) from None
    for proto in {m.group(1).lower() for m in re.finditer(r"([A-Za-z][A-Za-z0-9+.\-]*)(?=://|::)", url)}:
        try:
            get_filesystem_class(proto)
        except ValueError:
            raise ValueError(
                f"{owner}.{field}={url!r} names the protocol {proto!r}, which fsspec does not know; give a local "
                "path or a URL of an fsspec protocol (s3://, gs://, az://, file://, memory:// ...)"
            ) from None
        except ImportError as e:
            known = known_implementations.get(proto, {})
            package = str(known.get("class", proto)).split(".")[0]
            extra = " (or 'hasten[s3]')" if package == "s3fs" else ""
            raise ImportError(
                f"{owner}.{field}={url!r} needs fsspec's {proto!r} implementation, which is not installed "
                f"({e}): pip install {package}{extra}. Nothing was written"
            ) from None


def check_location(owner: str, field: str, value: Any) -> str:
    """``value`` as a location: a URL as written (its protocol installed, trailing ``/`` dropped),
    a ``file://`` URL as its local path, else the local path made absolute."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{owner}.{field} must be a path (str or os.PathLike) or a URL, got {value!r} ({type(value).__name__})"
        )
    path = os.fspath(value)
    if isinstance(path, str) and is_url(path):
        local = local_path(path)
        if local is not None:
            return os.path.abspath(local)
        check_protocol(owner, field, path)
        stripped = path.rstrip("/")
        return stripped if not stripped.endswith((":", ":/")) else path
    return os.path.abspath(path)
