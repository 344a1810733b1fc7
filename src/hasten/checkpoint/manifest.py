"""The manifest (``hasten_checkpoint.json``): written last, it makes a directory a checkpoint.

It names the layout the files follow (``layout``; "full" where absent, as in checkpoints of
earlier versions), the versions, world size, mixed precision, object counts, the models'
tensor tables and each file's size and SHA-256.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

MANIFEST = "hasten_checkpoint.json"
FORMAT = "hasten-checkpoint"
FORMAT_VERSION = 1
DEFAULT_LAYOUT = "full"


def build_manifest(layout: str, **fields: Any) -> dict[str, Any]:
    from .. import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "hasten_version": __version__,
        "torch_version": torch.__version__,
        **fields,
    }


def read_manifest(directory: str | os.PathLike, what: str = "load_state") -> dict[str, Any]:
    """The manifest of a complete checkpoint; a clear error for anything else (``what``: the
    command the messages name)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{what}: no checkpoint directory at {directory!r}")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(
            f"{what}: {directory!r} has no {MANIFEST}, so it is not a complete hasten checkpoint "
            "(a save that did not finish, or a directory written by something else)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: the manifest {path!r} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{what}: {path!r} is not a hasten checkpoint manifest")
    if not isinstance(manifest.get("format_version"), int) or manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{what}: {path!r} has format_version {manifest.get('format_version')!r}; "
            f"this hasten reads versions up to {FORMAT_VERSION}"
        )
    manifest.setdefault("layout", DEFAULT_LAYOUT)
    return manifest


def check_files(directory: str, manifest: dict[str, Any], where: str, names: Any = None, checksums: bool = True) -> None:
    """Each file the manifest lists (or only ``names``) is there with its recorded size and,
    with ``checksums``, its SHA-256; else a ``DamagedCheckpoint`` (a ValueError) naming the file."""
    from . import io

    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        raise ValueError(f"{where}: the manifest has a malformed 'files' table")
    for file_name in files if names is None else names:
        rec = files.get(file_name)
        if rec is None:
            raise io.DamagedCheckpoint(f"{where} is damaged: it holds {file_name!r}, which its manifest does not list")
        path = io.inside(directory, file_name, where)
        if not os.path.isfile(path):
            raise io.DamagedCheckpoint(f"{where} is incomplete: {file_name!r} is missing")
        size = os.path.getsize(path)
        if size != rec.get("size"):
            raise io.DamagedCheckpoint(f"{where} is damaged: {file_name!r} has {size} bytes, the manifest says {rec.get('size')}")
    if checksums:
        for file_name in files if names is None else names:
            expected = files[file_name].get("sha256")
            if expected is not None and io.record(os.path.join(directory, file_name))["sha256"] != expected:
                raise io.DamagedCheckpoint(f"{where} is damaged: {file_name!r} does not match its SHA-256 in the manifest")


def check_regions(directory: str, manifest: dict[str, Any], where: str, name: str, regions: list[tuple[int, int]]) -> bool:
    """Verify only ``regions`` (``(offset, length)``) of file ``name`` against the SHA-256 of
    its parts in the manifest, when each region is a recorded part and together they are less
    than half the file; True if done (a ``DamagedCheckpoint`` names the file and bytes that
    differ), False where the whole file is to be checked instead."""
    import hashlib

    from . import io

    rec = (manifest.get("files") or {}).get(name)
    try:
        parts = {(int(o), int(n)): str(h) for o, n, h in rec.get("parts", [])}
        size = int(rec["size"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    if not parts or not all(r in parts for r in regions) or 2 * sum(n for _, n in regions) >= size:
        return False
    check_files(directory, manifest, where, [name], checksums=False)  # there, at its size
    with open(io.inside(directory, name, where), "rb") as f:
        for offset, length in regions:
            f.seek(offset)
            if hashlib.sha256(f.read(length)).hexdigest() != parts[(offset, length)]:
                raise io.DamagedCheckpoint(
                    f"{where} is damaged: {name!r} bytes {offset}-{offset + length} do not match their SHA-256 in the manifest"
                )
    return True
