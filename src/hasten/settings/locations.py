"""Where a run's files can live: a local path, or a URL of any installed fsspec protocol.

A string that looks like a URL (``s3://bucket/run``, ``gs://...``, ``memory://x``,
``simplecache::s3://...``) is a URL, never a local path: its protocol is checked where the value
enters (``check_location``), and one whose package is not installed is refused there, naming
that package, before anything is written. ``file://`` is the local disk (``local_path``).
Credentials and endpoints are fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``,
``AWS_*``, ``~/.config/fsspec``), never a setting of hasten's. fsspec is imported only
for a URL.

This module is the one place a location string is judged: ``check_location`` (the calls that take
URLs) and ``check_url`` refuse, before anything is written, a string that starts with an installed
protocol's name and a colon but is no valid URL (``s3:/bucket/x``, ``s3:bucket/x``, ``file:rel``:
"did you mean 's3://bucket/x'?"), a chained URL whose target is no URL (``s3::/x``), a bucket or
path segment left empty (``s3:///x``, ``s3://b//x``) and, for a save, a protocol fsspec can only
read (``http://``). ``redact`` hides the password of ``scheme://user:password@`` in any text
hasten prints, logs or raises.
"""

from __future__ import annotations

import os
import re
from typing import Any

# scheme "://" (RFC 3986's letters), or fsspec's chaining "proto::"; a Windows drive ("C:\\") is no URL
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


# scheme ":" at the start of a string: a URL, or a typo of one where the scheme is an fsspec protocol
_SCHEME_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):")
# the credentials of "scheme://user:password@host"
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/@\s:'\"]*):(?P<secret>[^/@\s'\"]+)@")
# protocols whose fsspec implementation can only read: a save there is refused up front
READ_ONLY = frozenset({"http", "https", "github", "git", "zip", "tar", "libarchive", "reference", "data"})
# protocols whose URL holds a local path or a name of no bucket/host ("file:///tmp/x", "memory://x")
_NO_BUCKET = frozenset({"file", "local", "memory"})


def redact(text: Any) -> str:
    """``text`` (made a str) with the password of each ``scheme://user:password@`` in it replaced by
    ``***`` (``s3://KEY:***@bucket/x``), as pip, git and requests show URLs; everything else as it is."""
    return _CREDENTIALS.sub(lambda m: f"{m['head']}{m['user']}:***@", str(text))


def passwords(*locations: Any) -> tuple[str, ...]:
    """The passwords written in those of ``locations`` that are URLs (``scheme://user:password@``),
    for hiding wherever they appear (a storage library may quote ``KEY:SECRET@bucket`` alone)."""
    return tuple(m["secret"] for loc in locations if isinstance(loc, str) for m in _CREDENTIALS.finditer(loc))


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
            f"{owner}.{field}={redact(url)!r} is a URL, which hasten reads and writes through fsspec: "
            "pip install fsspec"
        ) from None
    for proto in {m.group(1).lower() for m in re.finditer(r"([A-Za-z][A-Za-z0-9+.\-]*)(?=://|::)", url)}:
        try:
            get_filesystem_class(proto)
        except ValueError:
            raise ValueError(
                f"{owner}.{field}={redact(url)!r} names the protocol {proto!r}, which fsspec does not know; give a "
                "local path or a URL of an fsspec protocol (s3://, gs://, az://, file://, memory:// ...)"
            ) from None
        except ImportError as e:
            known = known_implementations.get(proto, {})
            package = str(known.get("class", proto)).split(".")[0]
            extra = " (or 'hasten[s3]')" if package == "s3fs" else ""
            raise ImportError(
                f"{owner}.{field}={redact(url)!r} needs fsspec's {proto!r} implementation, which is not installed "
                f"({e}): pip install {package}{extra}. Nothing was written"
            ) from None


def _fsspec_protocols() -> set[str]:
    """The protocol names fsspec knows (installed or not)."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:  # pragma: no cover - torch depends on fsspec
        return set()
    return {p.lower() for p in (*known_implementations, *registry)}


def _refuse(owner: str, field: str, value: str, why: str, meant: str | None) -> ValueError:
    hint = f": did you mean {redact(meant)!r}?" if meant else "."
    return ValueError(f"{owner}.{field}={redact(value)!r} {why}{hint} Nothing was written")


def _suggest(proto: str, rest: str) -> str:
    """The URL ``proto:rest`` most likely meant (``s3:/b/x`` -> ``s3://b/x``; ``file:/x`` -> ``file:///x``)."""
    if proto in ("file", "local"):
        return f"file://{rest}" if rest.startswith("/") else rest
    return f"{proto}://{rest.lstrip('/')}"


def check_typo(owner: str, field: str, path: str) -> None:
    """Refuse a string that starts with an fsspec protocol's name and a colon but is no URL
    (``s3:/bucket/x``, ``s3:bucket/x``, ``file:rel``), naming the URL it likely meant: written as a
    local path it would make a folder named ``s3:``. A local name without a colon (``s3/x``) is a path."""
    match = _SCHEME_COLON.match(path) if isinstance(path, str) else None
    if match is None or is_url(path) or match.group(1).lower() not in _fsspec_protocols():
        return
    proto, rest = match.group(1).lower(), path[match.end() :]
    raise _refuse(owner, field, path, f"starts with the protocol {proto!r} but is not a URL ({proto}://...)",
                  _suggest(proto, rest))  # fmt: skip


def check_url(owner: str, field: str, url: str, write: bool = False) -> None:
    """Refuse a malformed URL before anything is read or written: a chained URL (``a::b://...``)
    whose parts are not protocol names ending in a URL (``s3::/x``), an empty bucket or host
    (``s3:///x``) or an empty path segment (``s3://b//x``: an object store would keep it as a
    name of its own); with ``write``, a protocol fsspec can only read (``READ_ONLY``: ``http://``)."""
    *chain, last = url.split("::")
    bad_chain = [p for p in chain if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", p)]
    if bad_chain or not is_url(last) or "://" not in last:
        rest = last.lstrip(":/") if not bad_chain else url.split("::")[-1]
        meant = _suggest(chain[-1].lower(), rest) if chain and not bad_chain else None
        raise _refuse(owner, field, url, "is a chained URL (proto::url) whose target is not a URL", meant)
    proto, rest = protocol_of(last), last.split("://", 1)[1].rstrip("/")
    segments = rest.split("/")
    if proto not in _NO_BUCKET and (not rest or "" in segments):
        named = "no bucket or host" if not segments[0] else "an empty path segment ('//')"
        meant = f"{proto}://{'/'.join(s for s in segments if s)}" if any(segments) else None
        raise _refuse(owner, field, url, f"names {named}", meant)
    if write and proto in READ_ONLY:
        raise ValueError(
            f"{owner}.{field}={redact(url)!r}: fsspec's {proto!r} protocol is read-only, nothing can be written "
            "there; save to a local path or to a URL of a store that takes writes (s3://, gs://, az://, ...)"
        )


def refuse_url(owner: str, field: str, path: Any, takes: str = "") -> None:
    """For a call that reads and writes local paths only: refuse a URL (``file://`` aside) by name,
    and a typo of one (``check_typo``), instead of making a folder named ``s3:`` (``takes``: the
    calls that do take URLs, for the message)."""
    if not isinstance(path, str):
        return
    check_typo(owner, field, path)
    if is_url(path) and local_path(path) is None:
        raise ValueError(
            f"{owner}.{field}={redact(path)!r} is a URL, and {owner} reads and writes local paths only"
            + (f"; {takes} take URLs" if takes else "")
        )


def check_location(owner: str, field: str, value: Any, write: bool = False) -> str:
    """``value`` as a location: a URL as written (well formed, ``check_url``; its protocol installed,
    trailing ``/`` dropped), a ``file://`` URL as its local path, else the local path made absolute
    (a typo of a URL refused, ``check_typo``). ``write``: the caller writes there."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{owner}.{field} must be a path (str or os.PathLike) or a URL, got {value!r} ({type(value).__name__})"
        )
    path = os.fspath(value)
    if isinstance(path, str):
        check_typo(owner, field, path)
    if isinstance(path, str) and is_url(path):
        local = local_path(path)
        if local is not None:
            return os.path.abspath(local)
        check_url(owner, field, path, write)
        check_protocol(owner, field, path)
        stripped = path.rstrip("/")
        return stripped if not stripped.endswith((":", ":/")) else path
    return os.path.abspath(path)
