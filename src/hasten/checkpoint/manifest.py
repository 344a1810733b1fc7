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
import re
from typing import Any

import torch

from hasten._version import __version__
from hasten.checkpoint import storage
from hasten.checkpoint.checksums import part_table, verify_file
from hasten.checkpoint.errors import DamagedCheckpoint
from hasten.checkpoint.files import inside

MANIFEST = "hasten_checkpoint.json"
FORMAT = "hasten-checkpoint"
FORMAT_VERSION = 1
DEFAULT_LAYOUT = "full"
_DCP_METADATA = re.compile(r"[\w-][\w.-]*/\.metadata")  # a DCP folder's metadata, as a save names it


def build_manifest(layout: str, **fields: Any) -> dict[str, Any]:
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
    st = storage.of(directory)
    path = st.join(directory, MANIFEST)
    storage.fetch_ahead(listing=directory)  # in a load at a URL: the folder's listing along with the manifest
    try:  # at a URL one request (a missing object is FileNotFoundError), no probe before it
        data = storage.read_bytes(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if not storage.isdir(directory):
            raise FileNotFoundError(f"{what}: no checkpoint directory at {directory!r}") from None
        raise ValueError(
            f"{what}: {directory!r} has no {MANIFEST}, so it is not a complete hasten checkpoint "
            "(a save that did not finish, or a directory written by something else)"
        ) from None
    except OSError as e:
        raise ValueError(f"{what}: the manifest {path!r} cannot be read: {e}") from e
    try:
        manifest = json.loads(data.decode("utf-8"))
    except ValueError as e:
        raise ValueError(f"{what}: the manifest {path!r} cannot be read: {e}") from e
    except RecursionError:  # JSON nested deeper than Python's parser goes: no save writes that
        raise DamagedCheckpoint(
            f"{what}: the manifest {path!r} is damaged: its JSON is nested deeper than any manifest a save "
            "writes (Python's parser gave up); nothing was restored"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{what}: {path!r} is not a hasten checkpoint manifest")
    version = manifest.get("format_version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise ValueError(
            f"{what}: {path!r} has format_version {version!r}; this hasten reads versions up to {FORMAT_VERSION}"
        )
    manifest.setdefault("layout", DEFAULT_LAYOUT)
    wrong = _wrong_field(manifest)
    if wrong is not None:
        field, value, allowed = wrong
        raise DamagedCheckpoint(f"{what}: the manifest {path!r} is damaged: {field} is {value!r}; it must be {allowed}")
    # in a load at a URL: each DCP folder's .metadata (every process reads them all), all at once
    listed = manifest.get("files", {})
    storage.fetch_ahead({st.join(directory, n): r["size"] for n, r in listed.items() if _DCP_METADATA.fullmatch(n)})
    return manifest


def _is_int(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


_NAT = "an integer >= 0"


def _wrong_field(manifest: dict[str, Any]) -> tuple[str, Any, str] | None:
    """``(field, value, what it must be)`` of the first field of ``manifest`` that no save writes
    (a type or range: a forged or damaged manifest), None if every field present is one a save
    writes. Fields a layout needs and lacks are the layout's to refuse (``FullLayout.read``)."""
    checks: list[tuple[str, Any, bool, str]] = [
        (
            "format_version",
            manifest.get("format_version"),
            _is_int(manifest.get("format_version"), 1),
            f"an integer >= 1 and <= {FORMAT_VERSION} (the versions this hasten reads)",
        ),
        ("layout", manifest["layout"], isinstance(manifest["layout"], str), "a layout's name (a string)"),
    ]
    for key, ok, allowed in (
        ("world_size", lambda x: _is_int(x, 1), "an integer >= 1 (the number of processes that saved it)"),
        ("step", lambda x: x is None or _is_int(x), f"null or {_NAT}"),
        ("scaler", lambda x: isinstance(x, bool), "true or false"),
        ("mixed_precision", lambda x: x is None or isinstance(x, str), "null or a string"),
        ("hasten_version", lambda x: isinstance(x, str), "a string"),
        ("torch_version", lambda x: isinstance(x, str), "a string"),
        (
            "counts",
            lambda x: isinstance(x, dict) and all(isinstance(k, str) and _is_int(n) for k, n in x.items()),
            f"an object of names and counts ({_NAT})",
        ),
        ("models", lambda x: isinstance(x, list), "a list"),
        ("files", lambda x: isinstance(x, dict), "an object of file names and records"),
    ):
        if key in manifest:
            checks.append((key, manifest[key], ok(manifest[key]), allowed))
    for field, value, ok_, allowed in checks:
        if not ok_:
            return field, value, allowed
    for i, entry in enumerate(manifest.get("models", [])):
        wrong = _wrong_model(i, entry)
        if wrong is not None:
            return wrong
    for name, rec in manifest.get("files", {}).items():
        wrong = _wrong_record(name, rec)
        if wrong is not None:
            return wrong
    return None


def _wrong_model(i: int, entry: Any) -> tuple[str, Any, str] | None:
    """The first wrong field of the manifest's ``models[i]``, or None."""
    if not isinstance(entry, dict):
        return f"models[{i}]", entry, "an object"
    for key in ("file", "dir"):
        if key in entry and not isinstance(entry[key], str):
            return f"models[{i}].{key}", entry[key], "a file name (a string)"
    tensors = entry.get("tensors", {})
    if not isinstance(tensors, dict):
        return f"models[{i}].tensors", tensors, "an object of tensor names and shapes"
    for name, info in tensors.items():
        field = f"models[{i}].tensors[{name!r}]"
        if not isinstance(info, dict):
            return field, info, "an object with a shape and a dtype"
        shape, dtype = info.get("shape"), info.get("dtype")
        if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
            return f"{field}.shape", shape, f"a list of sizes ({_NAT})"
        if not isinstance(dtype, str):
            return f"{field}.dtype", dtype, "a dtype's name (a string)"
    return None


def _wrong_record(name: Any, rec: Any) -> tuple[str, Any, str] | None:
    """The first wrong field of the manifest's record of file ``name``, or None (its parts are
    checked where they are used: ``checksums.part_table``)."""
    field = f"files[{name!r}]"
    if not isinstance(rec, dict):
        return field, rec, "an object with the file's size and checksum"
    if not _is_int(rec.get("size")):
        return f"{field}.size", rec.get("size"), f"the file's size in bytes ({_NAT})"
    for algorithm in ("xxh3_128", "sha256"):
        if algorithm in rec and not isinstance(rec[algorithm], str):
            return f"{field}.{algorithm}", rec[algorithm], "a hexadecimal digest (a string)"
    if "parts" in rec and not isinstance(rec["parts"], list):
        return f"{field}.parts", rec["parts"], "a list of [offset, length, digest]"
    return None


def check_files(
    directory: str, manifest: dict[str, Any], where: str, names: Any = None, checksums: bool = True
) -> None:
    """Each file the manifest lists (or only ``names``) is there with its recorded size and,
    with ``checksums``, its checksum; else a ``DamagedCheckpoint`` (a ValueError) naming the file."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        raise ValueError(f"{where}: the manifest has a malformed 'files' table")
    # at a URL, one listing of the folder rather than a request per file
    sizes = storage.of(directory).sizes(directory) if storage.is_url(directory) else None
    for file_name in files if names is None else names:
        rec = files.get(file_name)
        if rec is None:
            raise DamagedCheckpoint(f"{where} is damaged: it holds {file_name!r}, which its manifest does not list")
        path = inside(directory, file_name, where)
        size = _size(path) if sizes is None else sizes.get(file_name)
        if size is None:
            raise DamagedCheckpoint(f"{where} is incomplete: {file_name!r} is missing")
        if size != rec.get("size"):
            raise DamagedCheckpoint(
                f"{where} is damaged: {file_name!r} has {size} bytes, the manifest says {rec.get('size')}"
            )
    if checksums:
        if sizes is not None:  # at a URL the small files are downloaded at once, then each verified
            wanted = files if names is None else names
            storage.fetch_ahead({inside(directory, n, where): files[n]["size"] for n in wanted})
        for file_name in files if names is None else names:
            wrong = verify_file(inside(directory, file_name, where), files[file_name])
            if wrong is not None:
                raise DamagedCheckpoint(f"{where} is damaged: {file_name!r} {wrong} in the manifest")


def _size(path: str) -> int | None:
    """The size of the local file ``path``, None where there is no file."""
    return os.path.getsize(path) if os.path.isfile(path) else None


def region_digests(
    manifest: dict[str, Any], name: str, regions: list[tuple[int, int]]
) -> dict[tuple[int, int], str] | None:
    """The XXH3-128 of each of ``regions`` (``(offset, length)``) of file ``name``, when the
    manifest records each as a part of the file (an item DCP wrote there); else None (a checkpoint
    of an earlier version: the whole file is verified instead)."""
    table = part_table((manifest.get("files") or {}).get(name))
    if table is None:
        return None
    parts = {(o, n): h for o, n, h in table}
    if not all(r in parts for r in regions):
        return None
    return {r: parts[r] for r in regions}
