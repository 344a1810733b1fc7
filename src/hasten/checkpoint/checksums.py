"""Checksums of checkpoint files: XXH3-128 of each file (SHA-256 in checkpoints of earlier
versions), or of each part of a ``torch.distributed.checkpoint`` file (one per item in it).

``record`` reads a file and gives the manifest's record of it; ``verify_file`` checks a file
against its record. Files hasten writes are hashed as they are written (``files.write``,
``dcp_io.dcp_writer``), so a save never reads its files back.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from typing import Any

from hasten.checkpoint import storage

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


def record(path: str, checksum: bool = True, algorithm: str = CHECKSUM) -> dict[str, Any]:
    """A file's size and (with ``checksum``) its checksum (``algorithm``), as the manifest lists them."""
    out: dict[str, Any] = {"size": storage.getsize(path)}
    if checksum:
        out[algorithm] = _digest(lambda: _open(path), algorithm)
    return out


def _digest(opener: Callable[[], Any], algorithm: str) -> str:
    """The checksum (``algorithm``) of the file ``opener()`` opens."""
    h = hasher(algorithm)
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    with opener() as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def verify_file(path: str, rec: dict[str, Any]) -> str | None:
    """None if the file at ``path`` matches its manifest record ``rec`` (its whole-file checksum,
    or each of its parts, which must tile it), else what does not match, for the message
    (``"does not match its checksum"``, ``"bytes 10-20 do not match their checksum"``). A
    record with neither checks nothing here (its size is checked by the caller).

    A small file at a URL (``storage.KEEP_FILE``) is read whole in one request and verified in
    memory; inside ``storage.remembering()`` its reader then reads those bytes (``storage.keep``),
    so it is downloaded once and what is read is what was verified."""
    size = rec.get("size")
    if storage.is_url(path) and isinstance(size, int) and size <= storage.KEEP_FILE:
        data = storage.read_bytes(path)
        wrong = _verify(lambda: io.BytesIO(data), rec)
        if wrong is None:
            storage.keep(path, data)
        return wrong
    return _verify(lambda: _open(path), rec)


def _verify(opener: Callable[[], Any], rec: dict[str, Any]) -> str | None:
    """``verify_file`` of the file ``opener()`` opens."""
    expected = checksum_of(rec)
    if expected is not None:
        algorithm, digest = expected
        return None if _digest(opener, algorithm) == digest else "does not match its checksum"
    parts = part_table(rec)
    if parts is None:
        return None if "parts" not in rec else "has a malformed list of parts"
    buf = bytearray(1 << 22)
    with opener() as f:
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


def _open(path: str) -> Any:
    """``path`` opened to read: unbuffered on the local disk, in large blocks at a URL."""
    if storage.is_url(path):
        return storage.open(path, "rb", block_size=1 << 24)
    return open(path, "rb", buffering=0)


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
