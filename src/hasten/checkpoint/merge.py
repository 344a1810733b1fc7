"""``merge_weights``: one model's full weights, as one file, from a ``save_state`` checkpoint.

For a sharded ("dcp") checkpoint the shards are read and joined by ``torch.distributed.checkpoint``
(``dcp.load`` into full tensors), in this one process, without a process group; a "full"
checkpoint's model file is already whole and is copied. Nothing is unpickled but through the
allow-lists of ``unpickle`` (the torch file of a "full" checkpoint with ``weights_only=True``). The output
is the model's own state dict (its keys, no wrapper prefixes), loadable with
``model.load_state_dict(safetensors.torch.load_file(...))`` or ``hasten.checkpoint.load_model``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hasten import _validate as v
from hasten.checkpoint import dcp_io, errors, files, storage, unpickle, weights
from hasten.checkpoint.errors import DamagedCheckpoint
from hasten.checkpoint.manifest import check_files, read_manifest

WHAT = "merge-weights"
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
    (``pytorch_model.bin`` without ``safe_serialization``); returns the file's path.

    The model's files are checked first, as ``load_state`` checks them (present, their sizes
    and checksums as the manifest records them): a damaged checkpoint is refused by file name
    and nothing is written. The output file is written atomically, and ``output_dir`` is only
    created once the weights are merged, so a failure leaves no output behind.
    """
    checkpoint_dir = storage.check_location(WHAT, "checkpoint_dir", checkpoint_dir)  # a path or a URL
    output_dir = storage.check_location(WHAT, "output_dir", output_dir)
    v.check_number(WHAT, "model_index", model_index, integer=True, ge=0)
    v.check_bool(WHAT, "safe_serialization", safe_serialization)
    if storage.isfile(output_dir):
        raise ValueError(f"{WHAT}: the output {output_dir!r} is a file; give a folder (it is created if missing)")
    manifest = read_manifest(checkpoint_dir, WHAT)
    where = f"{WHAT}: the checkpoint {checkpoint_dir!r}"
    entries = manifest.get("models", [])
    if model_index >= len(entries):
        raise ValueError(f"{where} holds {len(entries)} model(s); model_index={model_index} is out of range")
    entry = entries[model_index]
    path = storage.of(output_dir).join(output_dir, SAFE_NAME if safe_serialization else UNSAFE_NAME)
    layout = manifest["layout"]
    if layout not in ("full", "dcp"):
        raise ValueError(f"{where} has the layout {layout!r}, which this hasten does not know")
    listed = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if layout == "full":
        mine = [entry.get("file")]
    else:
        prefix = f"{entry.get('dir')}/"
        mine = sorted(f for f in listed if f.startswith(prefix))
    missing = [f for f in mine if f not in listed]
    if missing or not mine:
        raise ValueError(
            f"{where}: its manifest lists no size or checksum for model {model_index}'s files {missing or mine}"
        )
    check_files(checkpoint_dir, manifest, where, mine)
    if layout == "full":
        state_dict = weights.read_weights(os.path.join(checkpoint_dir, entry["file"]))
    else:
        try:
            state_dict = _merged_dcp(os.path.join(checkpoint_dir, entry["dir"]), where)
        except BaseException as e:  # torch's reader fails deep inside, in a CheckpointException (a BaseException)
            if not isinstance(e, Exception) and not errors.is_dcp_exception(e):
                raise  # KeyboardInterrupt, SystemExit
            # a damaged or unsafe file: its own one-line error (an UnsafeCheckpoint names what it asked for)
            refused = next((c for c in errors._causes(e) if isinstance(c, DamagedCheckpoint)), None)
            if refused is not None:
                raise type(refused)(str(refused)) from None
            raise ValueError(
                f"{where}: cannot read model {model_index}'s shards in {entry['dir']!r}: {errors.first_line(e)}"
            ) from None
        weights.compare_tensors(entry["tensors"], weights.tensor_table(state_dict), f"{where} (model {model_index})")
    storage.of(output_dir).makedirs(output_dir)
    if safe_serialization:
        files.replace_file(path, weights.safetensors_payload(*weights.flat_tensors(state_dict, WHAT), WHAT))
    else:
        files.replace_file(path, lambda f: torch.save(state_dict, f))
    return path


def _merged_dcp(folder: str, where: str = "the checkpoint") -> dict[str, Any]:
    """The full tensors of one torch.distributed.checkpoint folder, read in this process (its
    files verified beforehand, or not at all): ``dcp.load`` into new tensors of the global shapes
    its metadata records, through ``dcp_io.dcp_reader`` and ``unpickle.dcp_planner``, so nothing is
    unpickled but through an allow-list (``.metadata`` is never ``pickle.load``-ed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp_io.dcp_reader(folder, lambda name, regions: None, where)
    metadata = reader.read_metadata()  # a damaged or unsafe .metadata: one clear error, before torch reads
    nested = metadata.planner_data or {}  # flattened key -> its path in the saved state dict
    target = {  # the state dict's own tensors (not those of a dict inside it), at their full shapes
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and len(nested.get(key, (key,))) == 1
    }
    dcp_io.dcp().load(target, storage_reader=reader, planner=unpickle.dcp_planner(reader, where), no_dist=True)
    return target
