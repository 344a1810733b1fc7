"""Reading a checkpoint's pickles without running anything they name.

A pickle names the functions and classes that rebuild its objects, and ``pickle.load`` imports
and calls whatever it names: a file crafted to name ``os.system`` runs a command, whatever its
checksum (the manifest's checksums detect damage, not a forger). hasten unpickles every file of
a checkpoint through an allow-list:

* DCP's ``.metadata`` (``read_dcp_metadata``, used by ``dcp_io.dcp_reader``): a ``pickle.Unpickler``
  whose ``find_class`` gives only torch.distributed.checkpoint's metadata classes,
  ``torch.Size``, dtypes, layouts, memory formats, ``pathlib`` paths and plain containers
  (``metadata_globals``), always: metadata never needs anything else (torch's own reader uses
  ``pickle.load``);
* every other pickle (``torch_load``): ``torch.load(weights_only=True)``, torch's allow-list of
  tensors and plain containers, DCP's non-tensor items included (``dcp_planner``; torch's planner
  reads them with ``weights_only=False``).

A file asking for anything else is an ``UnsafeCheckpoint`` naming the file and what it asked
for, and nothing of it runs; a ``.metadata`` that does not unpickle (truncated, a flipped byte)
is a ``DamagedCheckpoint``. ``weights_only=False`` (``load_state``/``load_model``) lifts torch's
allow-list for a trusted checkpoint holding other objects; it never applies to ``.metadata``.
"""

from __future__ import annotations

import functools
import io as pyio
import os
import pickle
import re
from typing import Any

from hasten.checkpoint import storage
from hasten.checkpoint.errors import DamagedCheckpoint, UnsafeCheckpoint

# torch.distributed.checkpoint.metadata's classes a .metadata file may hold (those of the
# installed torch are allowed; an older torch lacks some).
_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)


def refusal(what: str, asked: str, hint: str = "") -> str:
    """``what: it asks to load 'posix.system', which is not data ...``: the words of every refusal."""
    return (
        f"{what}: it asks to load {asked}, which is not data a checkpoint holds (hasten never runs code "
        f"from a checkpoint); nothing was loaded{hint}"
    )


@functools.cache
def metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object``: everything a DCP ``.metadata`` file may ask for.

    Found by saving real checkpoints (models and optimizers, FSDP2-sharded on 2 processes and
    on one): the metadata dataclasses, the filesystem writer's ``_StorageInfo``, ``torch.Size``,
    dtypes, layouts (pickled through ``torch.serialization._get_layout``, a name lookup) and
    memory formats, ``pathlib`` paths (the checkpoint id in ``StorageMeta``) and plain
    containers; each of them only builds data."""
    import collections
    import pathlib

    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in _METADATA_CLASSES
        if hasattr(metadata, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update(
        {
            ("torch", name): value
            for name, value in vars(torch).items()
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
        }
    )
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        for module in ("pathlib", "pathlib._local"):  # Python 3.13 pickles them from pathlib._local
            allowed[(module, cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that gives only ``metadata_globals``; anything else is refused by name."""

    def __init__(self, file: Any, what: str) -> None:
        super().__init__(file)
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        found = metadata_globals().get((module, name))
        if found is None:
            raise UnsafeCheckpoint(refusal(self._what, repr(f"{module}.{name}")))
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP's metadata never does")


def read_dcp_metadata(path: str, shown: str, where: str) -> Any:
    """DCP's ``Metadata`` from the ``.metadata`` file at ``path`` (``shown``: its name in messages,
    ``where``: the checkpoint's words), unpickled through the allow-list; an ``UnsafeCheckpoint``
    if it asks for anything else, a one-line ``DamagedCheckpoint`` if it cannot be read or does
    not hold DCP's metadata. At a URL it is one request, or none: the bytes its checksum was
    verified on, kept by ``checksums.verify_file`` inside ``storage.remembering()``."""
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{where} is incomplete: {shown!r} is missing") from None
    stream = pyio.BytesIO(data)
    try:
        metadata = _MetadataUnpickler(stream, f"{where}: cannot read {shown!r}").load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - what a damaged pickle raises varies (UnpicklingError, EOFError, ...)
        text = (str(e).strip().splitlines() or [""])[0][:200]
        raise DamagedCheckpoint(
            f"{where} is damaged: {shown!r} cannot be read ({type(e).__name__}: {text}); nothing was loaded"
        ) from None
    problem = "has bytes after its end" if stream.read(1) else _metadata_problem(metadata)
    if problem is not None:
        raise DamagedCheckpoint(f"{where} is damaged: {shown!r} {problem}; nothing was loaded")
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    """What makes ``metadata`` other than DCP's metadata of files in its folder, or None."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        return f"holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata"
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        return "has no table of its items or of where they are stored"
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            continue
        name, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in re.split(r"[\\/]", name):
            return f"places an item in {name!r}, which is not a file of its folder"
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in (offset, length)):
            return f"places an item at offset {offset!r}, length {length!r} of {name!r}"
    return None


def _asked_for(source: Any, error: BaseException) -> str | None:
    """The globals outside torch's allow-list that the torch file ``source`` names (``'a', 'b'``),
    read statically (nothing is run); else those torch's ``error`` names; None if none is known."""
    import torch.serialization

    try:
        if hasattr(source, "seek"):
            source.seek(0)
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - not a zip file of torch.save (the legacy format): torch's message
        names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(error))))
    return ", ".join(map(repr, names[:3])) + (" ..." if len(names) > 3 else "") if names else None


def torch_load(source: Any, what: str, weights_only: bool = True, hint: str = "", map_location: Any = "cpu") -> Any:
    """``torch.load(source, weights_only=weights_only)``; with ``weights_only``, a file asking
    for a global outside torch's allow-list is an ``UnsafeCheckpoint`` (``what``: the file in
    the message's words, ``hint``: added to it) naming what it asked for. Other failures are
    torch's (the callers say which file)."""
    import torch

    if storage.is_url(source):  # an object at a URL: its bytes (torch.load seeks back and forth)
        source = pyio.BytesIO(storage.read_bytes(source))
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        asked = _asked_for(source, e) if weights_only else None
        if asked is None:
            raise
        raise UnsafeCheckpoint(refusal(what, asked, hint)) from None


@functools.cache
def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import set_element

    class _AllowListed(DefaultLoadPlanner):
        """torch's ``DefaultLoadPlanner``, reading non-tensor items with ``torch_load``."""

        hasten_reader: Any
        hasten_where: str
        hasten_weights_only: bool

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            folder = os.path.basename(os.fspath(self.hasten_reader.path))
            shown = f"{folder}/{getattr(self.hasten_reader, 'hasten_reading', '')}"
            what = f"{self.hasten_where}: cannot read the item {fqn!r} of {shown!r}"
            hint = " (load_state(..., weights_only=False) loads a trusted checkpoint that holds such objects)"
            obj = torch_load(value, what, self.hasten_weights_only, hint, map_location=None)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _AllowListed


def dcp_planner(reader: Any, where: str, weights_only: bool = True) -> Any:
    """A load planner for ``dcp.load`` with ``reader`` (``dcp_io.dcp_reader``): torch's
    ``DefaultLoadPlanner``, whose non-tensor items (optimizer ``param_groups`` values, objects
    in a state dict) are read with ``torch.load(weights_only=weights_only)`` instead of
    torch's ``weights_only=False``; a refused item names its key and file (the one ``reader``
    is reading)."""
    planner = _planner_class()()
    planner.hasten_reader, planner.hasten_where, planner.hasten_weights_only = reader, where, weights_only
    return planner
