"""The manifest (``hasten_checkpoint.json``): written last, it makes a directory a checkpoint.

It names the layout the files follow (``layout``; "full" where absent, as in checkpoints of
earlier versions), the versions, world size, mixed precision, object counts, the models'
tensor tables and each file's size and checksum (XXH3-128; SHA-256 in checkpoints of earlier
versions); a ``torch.distributed.checkpoint`` file has one for each item in it instead ("parts",
which tile the file; checkpoints of earlier versions have both).
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
    with ``checksums``, its checksum; else a ``DamagedCheckpoint`` (a ValueError) naming the file."""
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
            wrong = io.verify_file(os.path.join(directory, file_name), files[file_name])
            if wrong is not None:
                raise io.DamagedCheckpoint(f"{where} is damaged: {file_name!r} {wrong} in the manifest")


def region_digests(manifest: dict[str, Any], name: str, regions: list[tuple[int, int]]) -> dict[tuple[int, int], str] | None:
    """The XXH3-128 of each of ``regions`` (``(offset, length)``) of file ``name``, when the
    manifest records each as a part of the file (an item DCP wrote there); else None (a checkpoint
    of an earlier version: the whole file is verified instead)."""
    from . import io

    table = io.part_table((manifest.get("files") or {}).get(name))
    if table is None:
        return None
    parts = {(o, n): h for o, n, h in table}
    if not all(r in parts for r in regions):
        return None
    return {r: parts[r] for r in regions}
