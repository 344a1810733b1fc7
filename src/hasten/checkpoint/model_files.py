"""Hugging Face-style model files (``save_model``/``load_model``) and ``save``.

``save_model`` writes ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards
plus ``model.safetensors.index.json`` above ``max_shard_size`` (``pytorch_model*.bin`` without
safetensors): what ``from_pretrained`` reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hasten import _validate as v
from hasten.checkpoint import errors, files, storage, weights
from hasten.checkpoint.slices import SafetensorsFile
from hasten.strategies import own_keys, unwrap_any
from hasten.strategies.materialise import copy_part, local_of, local_slices, mark_filled
from hasten.training.float8 import plain_state_dict

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.barrier import CopyBarrier
    from hasten.checkpoint.context import Checkpointable

logger = logging.getLogger(__name__)


def _tell_tied(aliases: dict[str, str], where: str) -> None:
    """Say which names a safetensors file leaves out (tied weights stored once), as Accelerate's
    ``save``/``save_model`` do: a reader other than hasten's sees only the stored names."""
    if aliases:
        logger.warning(
            f"{where}: Removed shared tensor {sorted(aliases)} while saving: each is the same tensor as another "
            f"name and is stored once ({', '.join(f'{a} -> {t}' for a, t in sorted(aliases.items()))}), the "
            "file's metadata naming it; hasten's load_model and load_checkpoint_in_model fill every name back, "
            "a reader that ignores that metadata (safetensors' load_file) sees only the stored names"
        )


def save_model(
    ctx: Checkpointable,
    model: torch.nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[str]:
    """Write the full weights of ``model`` (main process only; with ``save_on_each_node`` each
    machine's local main process), sharded above ``max_shard_size``.

    Each file is replaced atomically and the index is written last; shards of an earlier save
    in that layout that are no longer used are removed. Returns the paths. ``save_directory``
    may be a URL of an installed fsspec protocol (``s3://bucket/model``): each file one upload.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_model.model must be a torch.nn.Module, got {type(model).__name__}")
    directory = storage.check_location("save_model", "save_directory", save_directory)  # a path or a URL
    limit = files.parse_size(max_shard_size)
    v.check_bool("save_model", "safe_serialization", safe_serialization)
    st = storage.of(directory)
    if st.isfile(directory):
        raise ValueError(f"save_model.save_directory must be a directory, got the file {directory!r}")
    state_dict = ctx.strategy.model_state_dict(model)  # on every process: gathering shards is a collective
    if not ctx.writes_here():
        return []
    if safe_serialization:
        weights.require_safetensors("save_model")
        tensors, aliases = weights.flat_tensors(state_dict, "save_model")
        _tell_tied(aliases, "save_model")
    else:
        tensors, aliases = {k: t.detach().cpu() for k, t in state_dict.items()}, {}
    stem, ext = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    count = len(shards)
    names = [f"{stem}{ext}"] if count == 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}{ext}" for i in range(count)]

    st.makedirs(directory)
    paths = []
    for file_name, keys in zip(names, shards):
        part = {k: tensors[k] for k in keys}
        path = os.path.join(directory, file_name)
        if safe_serialization:
            files.replace_file(path, weights.safetensors_payload(part, aliases, "save_model"))
        else:
            files.replace_file(path, lambda f, part=part: torch.save(part, f))
        paths.append(path)
    index = os.path.join(directory, f"{stem}{ext}.index.json")
    if count > 1:
        weight_map = {k: names[i] for i, keys in enumerate(shards) for k in keys}
        weight_map.update({a: weight_map[t] for a, t in aliases.items()})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        body = {"metadata": {"total_size": total, weights.ALIASES_KEY: aliases}, "weight_map": weight_map}
        files.replace_file(index, lambda f: f.write(json.dumps(body, indent=1, sort_keys=True).encode()))
        paths.append(index)
    # Remove what an earlier save in this layout left behind (old shard counts, a stale index).
    stale = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}(\.index\.json)?$")
    for entry, folder in st.listdir(directory).items():
        path = os.path.join(directory, entry)
        if not folder and stale.fullmatch(entry) and path not in paths:
            st.remove(path)
    return paths


def _model_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files at ``path`` (a folder, one weights file, or an ``*.index.json``; a local
    path or a URL) and, for a sharded set, its weight map (name -> file path)."""
    st = storage.of(path)
    if st.isdir(path):
        for stem, ext in (("model", ".safetensors"), ("pytorch_model", ".bin")):
            single = st.join(path, f"{stem}{ext}")
            if st.exists(single + ".index.json"):
                return _model_files(single + ".index.json")
            if st.exists(single):
                return [single], None
        raise FileNotFoundError(f"load_model: no model.safetensors, pytorch_model.bin or index in {path!r}")
    if not st.exists(path):
        raise FileNotFoundError(
            f"load_model: {path!r} does not exist (give a folder save_model wrote, a .safetensors file or an "
            ".index.json)"
        )
    if path.endswith(".index.json"):
        try:
            with st.open(path, "r") as f:
                names = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"load_model: {path!r} is not a weight index (a JSON object with a 'weight_map'): {e}"
            ) from e
        folder = path.rpartition("/")[0] if st.url else os.path.dirname(path)
        weight_map = {k: files.inside(folder, f, f"load_model ({path!r})") for k, f in names.items()}
        found = sorted(set(weight_map.values()))
        files.require_listed(found, path, "load_model")
        return found, weight_map
    return [path], None


def load_model(
    model: torch.nn.Module,
    directory: str | os.PathLike,
    weights_only: bool = True,
    *,
    strategy: Any = None,
    barrier: CopyBarrier | None = None,
) -> None:
    """Load what ``save_model`` (or Hugging Face's ``save_pretrained``) wrote into ``model``.

    ``directory`` is a folder (``model.safetensors``, shards with ``model.safetensors.index.json``,
    or ``pytorch_model*.bin``), one ``.safetensors`` file or an ``.index.json``, on the local
    disk or at a URL of an installed fsspec protocol (``s3://bucket/model``), where safetensors
    files are read in ranged reads, not downloaded whole. Strict: names and shapes must match; a
    tied weight stored once loads into every name it has. Safetensors files are read in parts: a
    model sharded with FSDP2 reads only this process's rows of each tensor (``slices``).
    ``strategy`` (``Accelerator.load_model`` passes its own) loads the other formats into a
    sharded model; ``barrier`` (its ``CopyBarrier``): the weights are changed only once an
    asynchronous ``save_state`` in flight has copied them.

    Nothing in the files runs: safetensors files hold no code, and torch files
    (``pytorch_model*.bin``) are read with ``torch.load(weights_only=True)``, whose allow-list
    holds tensors and plain containers; a file asking for anything else (``os.system``, a
    class of its own) is refused with an ``UnsafeCheckpoint`` naming the file and what it asked
    for, and the model is not changed. ``weights_only=False`` lifts that for a trusted file
    (it runs whatever the file names).
    """
    if storage.is_url(directory):  # an installed fsspec protocol's, else refused naming its package
        path = storage.check_location("load_model", "directory", directory)
    else:
        path = files.check_path("load_model", "directory", directory)
    found, weight_map = _model_files(path)
    if barrier is not None:
        barrier.wait()  # an asynchronous save_state may still be copying these weights
    target = unwrap_any(model)
    current = plain_state_dict(target.state_dict())  # fp8's float8 weights: the plain tensors they hold
    if all(f.endswith(".safetensors") for f in found):
        _load_safetensors(target, current, found, weight_map, path)
    else:
        state: dict[str, torch.Tensor] = {}
        for file_name in found:
            state.update(weights.read_weights(file_name, weights_only))
        state = own_keys(state, current.keys())  # written by other tools from a compiled/DDP model
        weights.compare_tensors(weights.tensor_table(state), weights.tensor_table(current), f"the weights in {path!r}")
        if strategy is not None:
            strategy.load_model_state_dict(model, state)
        else:
            target.load_state_dict(state)
    mark_filled(target, current.keys())


def _load_safetensors(
    target: torch.nn.Module, current: dict[str, Any], paths: list[str], weight_map: dict[str, str] | None, where: str
) -> None:
    opened = {f: SafetensorsFile(f) for f in paths}
    located: dict[str, tuple[SafetensorsFile, str]] = {}
    for sf in opened.values():
        for name in sf.entries:
            if weight_map is None or weight_map.get(name) == sf.path:
                located[name] = (sf, name)
        for alias, stored in json.loads(sf.metadata.get(weights.ALIASES_KEY, "{}")).items():
            if stored in sf.entries:
                located[alias] = (sf, stored)
    located = own_keys(located, current.keys())  # written by other tools from a compiled/DDP model
    # A tied weight stored once (Hugging Face drops the copies): each name of it reads that entry.
    by_storage: dict[Any, str] = {}
    for name, t in current.items():
        key = _storage_key(t)
        if name in located:
            by_storage.setdefault(key, name)
    for name, t in current.items():
        if name not in located and _storage_key(t) in by_storage:
            located[name] = located[by_storage[_storage_key(t)]]
    table = {n: sf.table()[stored] for n, (sf, stored) in located.items()}
    weights.compare_tensors(table, weights.tensor_table(current), f"the weights in {where!r}")
    handles = {f: storage.open_ranges(f) for f in opened}  # only the bytes asked for (ranged reads at a URL)
    try:
        done: set[Any] = set()
        for name in _in_file_order(current, located):
            dest = current[name]
            if _storage_key(dest) in done:
                continue  # the other name of a tied weight, read once
            done.add(_storage_key(dest))
            sf, stored = located[name]
            part = local_slices(dest)
            rows_only = part is not None and all(s == slice(0, n) for s, n in zip(part[1:], dest.shape[1:]))
            if rows_only:  # this process's rows: one read of just their bytes
                values = sf.read_rows(handles[sf.path], stored, part[0])
                with torch.no_grad():
                    local_of(dest).copy_(values.reshape(local_of(dest).shape))
            else:
                copy_part(dest, sf.read_rows(handles[sf.path], stored))
    finally:
        for h in handles.values():
            h.close()


def _in_file_order(current: dict[str, Any], located: dict[str, tuple[SafetensorsFile, str]]) -> list[str]:
    """The names of ``current`` in the order their bytes lie in the files (file by file): a URL's
    reads then follow one another, each taking what the one before read ahead."""
    order = {name: i for i, name in enumerate(current)}
    return sorted(
        current,
        key=lambda n: (located[n][0].path, located[n][0].entries[located[n][1]]["data_offsets"][0], order[n]),
    )


def _storage_key(t: torch.Tensor) -> Any:
    local = local_of(t)
    return (
        (str(local.device), local.untyped_storage().data_ptr(), local.storage_offset()) if not local.is_meta else id(t)
    )


def save(ctx: Checkpointable, obj: Any, f: Any, safe_serialization: bool = False) -> None:
    """``torch.save(obj, f)`` on the main process only (each machine's local main process with
    ``ProjectConfiguration(save_on_each_node=True)``); a path is replaced atomically, a URL of an
    installed fsspec protocol written in one upload (an object appears whole or not at all).

    With ``safe_serialization`` ``obj`` must be a dict of tensors, written as safetensors.
    """
    v.check_bool("save", "safe_serialization", safe_serialization)
    # a path or a URL (one upload, never a local folder named "s3:"), checked on every process
    path = storage.check_location("save", "f", f, write=True) if isinstance(f, (str, os.PathLike)) else None
    if not ctx.writes_here():
        return
    if safe_serialization:
        weights.require_safetensors("save(safe_serialization=True)")
        if not isinstance(obj, dict):
            raise TypeError(f"save(safe_serialization=True) takes a dict of tensors, got {type(obj).__name__}")
        tensors, aliases = weights.flat_tensors(obj, "save")
        _tell_tied(aliases, "save")
        write: Callable[[Any], None] = weights.safetensors_payload(tensors, aliases, "save")
    else:
        write = lambda fh: torch.save(obj, fh)  # noqa: E731
    if path is not None:
        if not storage.is_url(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with errors.secrets_hidden(path):
            files.replace_file(path, write)
    elif hasattr(f, "write"):
        write(f)
    else:
        raise TypeError(f"save.f must be a path or a writable file object, got {f!r} ({type(f).__name__})")
