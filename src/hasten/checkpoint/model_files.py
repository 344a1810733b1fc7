"""Hugging Face-style model files (``save_model``/``load_model``) and ``save``.

``save_model`` writes ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards
plus ``model.safetensors.index.json`` above ``max_shard_size`` (``pytorch_model*.bin`` without
safetensors): what ``from_pretrained`` reads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import _validate as v
from ..strategies import own_keys, unwrap_any
from . import io

if TYPE_CHECKING:  # pragma: no cover
    from .context import Checkpointable


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
    in that layout that are no longer used are removed. Returns the paths.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_model.model must be a torch.nn.Module, got {type(model).__name__}")
    directory = io.check_path("save_model", "save_directory", save_directory)
    limit = io.parse_size(max_shard_size)
    v.check_bool("save_model", "safe_serialization", safe_serialization)
    if os.path.isfile(directory):
        raise ValueError(f"save_model.save_directory must be a directory, got the file {directory!r}")
    state_dict = ctx.strategy.model_state_dict(model)  # on every process: gathering shards is a collective
    if not ctx.writes_here():
        return []
    if safe_serialization:
        io.require_safetensors("save_model")
        tensors, aliases = io.flat_tensors(state_dict, "save_model")
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

    os.makedirs(directory, exist_ok=True)
    paths = []
    for file_name, keys in zip(names, shards):
        part = {k: tensors[k] for k in keys}
        path = os.path.join(directory, file_name)
        if safe_serialization:
            io.replace_file(path, io.safetensors_payload(part, aliases, "save_model"))
        else:
            io.replace_file(path, lambda f, part=part: torch.save(part, f))
        paths.append(path)
    index = os.path.join(directory, f"{stem}{ext}.index.json")
    if count > 1:
        weight_map = {k: names[i] for i, keys in enumerate(shards) for k in keys}
        weight_map.update({a: weight_map[t] for a, t in aliases.items()})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        body = {"metadata": {"total_size": total, io.ALIASES_KEY: aliases}, "weight_map": weight_map}
        io.replace_file(index, lambda f: f.write(json.dumps(body, indent=1, sort_keys=True).encode()))
        paths.append(index)
    # Remove what an earlier save in this layout left behind (old shard counts, a stale index).
    stale = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}(\.index\.json)?$")
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if stale.fullmatch(entry) and path not in paths:
            os.remove(path)
    return paths


def load_model(model: torch.nn.Module, directory: str | os.PathLike, weights_only: bool = True) -> None:
    """Load what ``save_model`` wrote into ``model`` (strict: names and shapes must match)."""
    directory = io.check_path("load_model", "directory", directory)
    for stem, ext in (("model", ".safetensors"), ("pytorch_model", ".bin")):
        single = os.path.join(directory, f"{stem}{ext}")
        index = single + ".index.json"
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for file_name in sorted(set(weight_map.values())):
                state.update(io.read_weights(os.path.join(directory, file_name), weights_only))
            break
        if os.path.exists(single):
            state = io.read_weights(single, weights_only)
            break
    else:
        raise FileNotFoundError(f"load_model: no model.safetensors, pytorch_model.bin or index in {directory!r}")
    target = unwrap_any(model)
    current = target.state_dict()
    state = own_keys(state, current.keys())  # written by other tools from a compiled/DDP model
    io.compare_tensors(io.tensor_table(state), io.tensor_table(current), f"the weights in {directory!r}")
    target.load_state_dict(state)


def save(ctx: Checkpointable, obj: Any, f: Any, safe_serialization: bool = False) -> None:
    """``torch.save(obj, f)`` on the main process only (each machine's local main process with
    ``ProjectConfiguration(save_on_each_node=True)``); a path is replaced atomically.

    With ``safe_serialization`` ``obj`` must be a dict of tensors, written as safetensors.
    """
    v.check_bool("save", "safe_serialization", safe_serialization)
    if not ctx.writes_here():
        return
    if safe_serialization:
        io.require_safetensors("save(safe_serialization=True)")
        if not isinstance(obj, dict):
            raise TypeError(f"save(safe_serialization=True) takes a dict of tensors, got {type(obj).__name__}")
        write: Callable[[Any], None] = io.safetensors_payload(*io.flat_tensors(obj, "save"), "save")
    else:
        write = lambda fh: torch.save(obj, fh)  # noqa: E731
    if isinstance(f, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(f))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        io.replace_file(path, write)
    elif hasattr(f, "write"):
        write(f)
    else:
        raise TypeError(f"save.f must be a path or a writable file object, got {f!r} ({type(f).__name__})")
