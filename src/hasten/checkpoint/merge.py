"""``merge_weights``: one model's full weights, as one file, from a ``save_state`` checkpoint.

For a sharded ("dcp") checkpoint the shards are read and joined by
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, in this one process, without
a process group; a "full" checkpoint's model file is already whole and is copied. The output
is the model's own state dict (its keys, no wrapper prefixes), loadable with
``model.load_state_dict(safetensors.torch.load_file(...))`` or ``hasten.checkpoint.load_model``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

from .. import _validate as v
from . import io
from .manifest import read_manifest

SAFE_NAME = "model.safetensors"
UNSAFE_NAME = "pytorch_model.bin"


def merge_weights(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    model_index: int = 0,
    safe_serialization: bool = True,
) -> str:
    """Write model ``model_index`` of the checkpoint to ``output_dir/model.safetensors``
    (``pytorch_model.bin`` without ``safe_serialization``); returns the file's path."""
    checkpoint_dir = io.check_path("merge_weights", "checkpoint_dir", checkpoint_dir)
    output_dir = io.check_path("merge_weights", "output_dir", output_dir)
    v.check_number("merge_weights", "model_index", model_index, integer=True, ge=0)
    v.check_bool("merge_weights", "safe_serialization", safe_serialization)
    manifest = read_manifest(checkpoint_dir)
    entries = manifest.get("models", [])
    if model_index >= len(entries):
        raise ValueError(
            f"merge_weights: the checkpoint {checkpoint_dir!r} holds {len(entries)} model(s); "
            f"model_index={model_index} is out of range"
        )
    entry = entries[model_index]
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, SAFE_NAME if safe_serialization else UNSAFE_NAME)
    if manifest["layout"] == "full":
        source = os.path.join(checkpoint_dir, entry["file"])
        if source.endswith(".safetensors") == safe_serialization:
            shutil.copyfile(source, path)
        else:
            io.write_weights(path, io.read_weights(source), safe_serialization, "merge_weights")
        return path
    if manifest["layout"] != "dcp":
        raise ValueError(f"merge_weights: the checkpoint layout {manifest['layout']!r} is not known to this hasten")
    state_dict = _merged_dcp(os.path.join(checkpoint_dir, entry["dir"]))
    io.compare_tensors(entry["tensors"], io.tensor_table(state_dict), f"merge_weights ({checkpoint_dir!r}, model {model_index})")
    io.write_weights(path, state_dict, safe_serialization, "merge_weights")
    return path


def _merged_dcp(folder: str) -> dict[str, Any]:
    """The full state dict of one torch.distributed.checkpoint folder, read in this process."""
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="hasten-merge-") as tmp:
        merged = os.path.join(tmp, "merged.pt")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp_to_torch_save(folder, merged)
        state_dict = torch.load(merged, map_location="cpu", weights_only=True)
    return {k: t for k, t in state_dict.items() if isinstance(t, torch.Tensor)}
