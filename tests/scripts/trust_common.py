"""Crafted checkpoint files for the tests of "nothing in a checkpoint is executed" (issue 38).

``Payload(marker)`` pickles as ``os.system("touch MARKER")``: a file holding it creates
``marker`` if anything unpickles it without an allow-list. Each helper changes a saved
checkpoint as an attacker would, then recomputes the manifest's records of the files it
changed (``rehash``), so the checksums pass and only the allow-lists stand in the way.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shlex
from pathlib import Path
from typing import Any

import torch

MANIFEST = "hasten_checkpoint.json"


class Payload:
    """Unpickles as ``os.system("touch marker")`` (and pickles to ``posix.system``)."""

    def __init__(self, marker: str | os.PathLike) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def rehash(ck: str | os.PathLike, *names: str) -> None:
    """Record each file's new size and XXH3-128 in the manifest, as a forger would."""
    from hasten.checkpoint.checksums import record

    path = Path(ck) / MANIFEST
    manifest = json.loads(path.read_text())
    for name in names:
        manifest["files"][name] = record(str(Path(ck) / name))
    path.write_text(json.dumps(manifest))


def edit_manifest(ck: str | os.PathLike, **fields: Any) -> None:
    path = Path(ck) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


def _metadata(ck: str | os.PathLike, folder: str) -> Any:
    with open(Path(ck) / folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own checkpoint, written a moment ago


def craft_metadata(ck: str | os.PathLike, marker: str | os.PathLike, folder: str = "model_0") -> None:
    """``folder/.metadata`` with a payload among its planner data (a load that unpickles it
    with ``pickle.load`` runs it, then succeeds: nothing reads that entry)."""
    metadata = _metadata(ck, folder)
    metadata.planner_data["zzz"] = Payload(marker)
    (Path(ck) / folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ck, f"{folder}/.metadata")


def craft_item(
    ck: str | os.PathLike, marker: str | os.PathLike, folder: str = "optimizer_0", key: str = "param_groups.0.lr"
) -> str:
    """The non-tensor DCP item ``key`` (a ``torch.save``-d object, read by torch's planner with
    ``weights_only=False``) replaced by a payload appended to its file; returns that file's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = _metadata(ck, folder)
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    shard = Path(ck) / folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()))
    (Path(ck) / folder / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ck, f"{folder}/.metadata", f"{folder}/{info.relative_path}")
    return f"{folder}/{info.relative_path}"


def damage_metadata(ck: str | os.PathLike, how: str = "flip", folder: str = "model_0", recompute: bool = False) -> None:
    """``folder/.metadata`` with its first byte flipped ("flip"), cut in half ("cut") or
    replaced by garbage of the same size ("garbage"); ``recompute``: the manifest's record too."""
    path = Path(ck) / folder / ".metadata"
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[0] ^= 0xFF
    elif how == "cut":
        data = data[: len(data) // 2]
    else:
        data = bytearray(random.Random(0).randbytes(len(data)))
    path.write_bytes(bytes(data))
    if recompute:
        rehash(ck, f"{folder}/.metadata")


def craft_torch_file(ck: str | os.PathLike, name: str, marker: str | os.PathLike, manifest: bool = True) -> None:
    """The torch file ``name`` of a "full" checkpoint (of a ``save_model`` folder: no
    ``manifest``) with a payload inside its own structure."""
    path = Path(ck) / name
    obj = torch.load(path, weights_only=False)  # a file this test wrote (an RNG file holds NumPy arrays)
    if name.startswith("optimizer"):
        obj["param_groups"][0]["lr"] = Payload(marker)
    else:
        obj["payload"] = Payload(marker)
    torch.save(obj, path)
    if manifest:
        rehash(ck, name)
