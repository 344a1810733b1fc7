"""Loading a checkpoint into a model, as Accelerate's ``accelerate.utils.modeling`` loads:
``load_state_dict`` (one file) and ``load_checkpoint_in_model`` (a file, an index of shards or a
folder), each tensor onto its module's device by a device map, "disk" ones into an offload folder.

Files are read through ``hasten.checkpoint``'s reading (safetensors, or torch files through the
unpickling allow-list): nothing in a checkpoint runs. A weight sent to "disk" that the checkpoint
already holds in a local safetensors file at the dtype asked for is not copied: the offload
index points at that file (``safetensors_file``), read when the layer runs; others are written
to the offload folder as raw ``.dat`` files (``hasten.big_model.offload``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch

from hasten.big_model.offload import load_offloaded_weights, offload_weight, save_offload_index
from hasten.big_model.planning import check_tied_parameters_on_same_device
from hasten.big_model.tensors import (
    _as_dtype,
    check_tied_parameters_in_config,
    find_tied_parameters,
    retie_parameters,
    set_module_tensor_to_device,
)
from hasten.settings import locations

__all__ = ["load_checkpoint_in_model", "load_state_dict"]

logger = logging.getLogger(__name__)


def _safetensors_format(path: str) -> None:
    """Accelerate's check of a safetensors file's ``format`` metadata (pt; none is taken as pt)."""
    from hasten.checkpoint import storage

    if storage.is_url(path):  # its header only, in ranged reads
        from hasten.checkpoint.slices import SafetensorsFile

        metadata = SafetensorsFile(path).raw_metadata
    else:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
    if metadata is None:
        logger.warning(
            f"The safetensors archive passed at {path} does not contain metadata. Make sure to save your model with "
            "the `save_pretrained` method. Defaulting to 'pt' metadata."
        )
        return
    found = metadata.get("format")
    if found not in ("pt", "tf", "flax"):
        raise OSError(
            f"The safetensors archive passed at {path} does not contain the valid metadata. Make sure you save your "
            "model with the `save_pretrained` method."
        )
    if found != "pt":
        raise ValueError(f"The checkpoint passed was saved with {found}, we need a the pt format.")


def _device_of(key: str, device_map: dict[str, Any]) -> Any:
    """Where ``device_map`` sends ``key``: its longest module prefix's device, else the CPU
    ("disk" is read to the CPU, as Accelerate reads it)."""
    values = set(device_map.values())
    if len(values) == 1:
        device = next(iter(values))
    else:
        device = next(
            (d for m, d in device_map.items() if d != "disk" and (key == m or key.startswith(m + "."))), "cpu"
        )
    return "cpu" if device == "disk" else device


def load_state_dict(checkpoint_file: str | os.PathLike, device_map: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tensors of one checkpoint file (safetensors, or a torch file), each on the device
    ``device_map`` (module name -> device) gives its module, else on the CPU, as Accelerate's.

    Read through hasten's checkpoint reading: a torch file with ``torch.load(weights_only=True)``
    (a file naming any other class or function is an ``UnsafeCheckpoint``; nothing in it runs),
    a safetensors file with the tied weights hasten stored once filled back. ``checkpoint_file``
    may be a URL of an installed fsspec protocol (``s3://bucket/model/model.safetensors``)."""
    from hasten.checkpoint import weights

    path = _location(checkpoint_file, "load_state_dict", "checkpoint_file")
    if path.endswith(".safetensors"):
        weights.require_safetensors("load_state_dict")
        _safetensors_format(path)
    tensors = weights.read_weights(path)
    if not device_map:
        return tensors
    return {k: t.to(_device_of(k, device_map)) for k, t in tensors.items()}


def _location(value: str | os.PathLike, owner: str, field: str) -> str:
    """A local path as given; a URL checked (its fsspec protocol installed, else refused naming
    the package; ``file://`` is the local path it names)."""
    from hasten.checkpoint import storage

    path = os.fspath(value)
    return storage.check_location(owner, field, path) if storage.is_url(path) else path


def _checkpoint_files(checkpoint: str | os.PathLike) -> tuple[list[str], list[str] | None]:
    """The files of ``checkpoint`` (a file, an ``.index.json``, or a folder holding
    ``pytorch_model.bin``, ``model.safetensors`` or one index; a local path or a URL), as
    Accelerate finds them, and the names an index lists (None without an index)."""
    from hasten.checkpoint import files, storage

    path = _location(checkpoint, "load_checkpoint_in_model", "checkpoint")
    st = storage.of(path)
    index = None
    if st.isfile(path):
        if not path.endswith(".json"):
            return [path], None
        index = path
    elif st.isdir(path):
        entries = st.listdir(path) if st.url else os.listdir(path)
        for single in ("pytorch_model.bin", "model.safetensors"):
            if single in entries:
                return [st.join(path, single)], None
        found = [f for f in entries if f.endswith(".index.json")]
        if len(found) != 1:
            raise ValueError(
                f"{path} containing more than one `.index.json` file, delete the irrelevant ones."
                if found
                else f"{path} is not a folder containing a `.index.json` file or a pytorch_model.bin or a "
                "model.safetensors file"
            )
        index = st.join(path, found[0])
    else:
        raise ValueError(
            "`checkpoint` should be the path to a file containing a whole state dict, or the index of a sharded "
            f"checkpoint, or a folder containing a sharded checkpoint or the whole state dict, but got {path}."
        )
    with st.open(index, "r") as f:
        weight_map = json.load(f)
    weight_map = weight_map.get("weight_map", weight_map)
    folder = index.rpartition("/")[0] if st.url else os.path.dirname(index)
    where = f"load_checkpoint_in_model ({index!r})"
    paths = [files.inside(folder, n, where) for n in sorted(set(weight_map.values()))]
    files.require_listed(paths, index, "load_checkpoint_in_model")
    return paths, list(weight_map)


def _check_keys(model: torch.nn.Module, given: Any, model_keys: set[str]) -> None:
    """``strict``: the checkpoint's names must be the model's (a tied weight stored once counts
    for every name of it), checked before anything is loaded."""
    given = set(given)
    tied = {n for group in find_tied_parameters(model) if given & set(group) for n in group}
    missing = sorted(model_keys - given - tied)
    unexpected = sorted(given - model_keys)
    if missing or unexpected:
        parts = [f"Missing key(s) in state_dict: {missing}."] if missing else []
        parts += [f"Unexpected key(s) in state_dict: {unexpected}."] if unexpected else []
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__} (strict=True; nothing was loaded):\n\t"
            + "\n\t".join(parts)
        )


def _load_whole(
    model: torch.nn.Module, loaded: dict[str, Any], full_state_dict: bool, broadcast_from_rank0: bool
) -> None:
    """One file's tensors into ``model`` where they are (torch's ``set_model_state_dict``, which
    shards them into an FSDP2 model); a model on the meta device takes them as they are."""
    from hasten.strategies.base import has_dtensor

    meta = any(t.is_meta for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    if meta and not broadcast_from_rank0 and not has_dtensor(model.state_dict()):
        keys = set(model.state_dict())
        model.load_state_dict({k: t for k, t in loaded.items() if k in keys}, strict=False, assign=True)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=full_state_dict, strict=False, broadcast_from_rank0=broadcast_from_rank0)
    set_model_state_dict(model, loaded, options=options)


class _Offloads:
    """Where ``load_checkpoint_in_model`` puts the tensors it does not keep in memory: "disk" ones
    in ``folder`` (its ``index``), "cpu" ones under ``offload_state_dict`` in a temporary folder
    loaded back at the end (``temp``, ``temp_index``)."""

    def __init__(self, model: torch.nn.Module, folder: Any, offload_state_dict: bool, offload_buffers: bool) -> None:
        self.folder = folder
        self.index: dict[str, Any] = {}
        self.temp = tempfile.mkdtemp() if offload_state_dict else None
        self.temp_index: dict[str, Any] = {}
        self.offload_buffers = offload_buffers
        self.buffers = {name for name, _ in model.named_buffers()}
        self.in_file: dict[str, str] = {}  # name -> the local safetensors file holding it (this shard's)

    def shard(self, path: str) -> None:
        """The names ``path`` holds as they are (a local safetensors file), to point at rather than copy."""
        self.in_file = {}
        if path.endswith(".safetensors") and os.path.isfile(path):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                self.in_file = dict.fromkeys(f.keys(), os.path.abspath(path))

    def to_disk(self, model: torch.nn.Module, name: str, value: torch.Tensor, dtype: torch.dtype | None) -> None:
        dtype = value.dtype if dtype is None or not value.is_floating_point() else dtype
        set_module_tensor_to_device(model, name, "meta", dtype=dtype)
        if name in self.in_file and dtype == value.dtype:
            self.index[name] = {"safetensors_file": self.in_file[name], "weight_name": name, "dtype": _name(dtype)}
        else:
            offload_weight(value.to(dtype), name, self.folder, index=self.index)

    def to_temp(self, model: torch.nn.Module, name: str, value: torch.Tensor, dtype: torch.dtype | None) -> None:
        dtype = value.dtype if dtype is None or not value.is_floating_point() else dtype
        set_module_tensor_to_device(model, name, "meta", dtype=dtype)
        offload_weight(value.to(dtype), name, self.temp, index=self.temp_index)

    def finish(self, model: torch.nn.Module) -> None:
        """Write the offload index; load the temporarily offloaded CPU tensors back."""
        if self.folder is not None:
            save_offload_index(self.index, self.folder)
        if self.temp is not None:
            try:
                load_offloaded_weights(model, self.temp_index, self.temp)
                for name in self.temp_index:  # read from the files: copied before the folder goes
                    owner, attr = name.rpartition(".")[0], name.rpartition(".")[2]
                    tensor = getattr(model.get_submodule(owner), attr)
                    set_module_tensor_to_device(model, name, "cpu", value=tensor.clone())
            finally:
                shutil.rmtree(self.temp, ignore_errors=True)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _target_dtype(name: str, value: torch.Tensor, dtype: torch.dtype | None, keep_fp32: list[str] | None) -> Any:
    """``dtype`` for a floating tensor (float32 for ``keep_in_fp32_modules`` under fp16), else None."""
    if dtype is None or not value.is_floating_point():
        return None
    if dtype == torch.float16 and keep_fp32 and any((k in name and k + "." in name) or k == name for k in keep_fp32):
        return torch.float32
    return dtype


def _load_mapped(
    model: torch.nn.Module,
    loaded: dict[str, Any],
    model_keys: set[str],
    device_map: dict[str, Any],
    dtype: torch.dtype | None,
    keep_in_fp32_modules: list[str] | None,
    offloads: _Offloads,
) -> None:
    """One file's tensors, each put on its module's device by ``device_map`` (cast to ``dtype``,
    fp32 kept for ``keep_in_fp32_modules`` under fp16), as Accelerate does: "disk" ones (and
    buffers only with ``offload_buffers``) into the offload folder, leaving meta in the model."""
    for name, value in loaded.items():
        if "SCB" in name or name not in model_keys:
            continue  # bitsandbytes' statistics; names the model does not have
        module = name
        while module and module not in device_map:
            module = module.rpartition(".")[0]
        if module == "" and "" not in device_map:
            raise ValueError(f"{name} doesn't have any device set.")
        device = device_map[module]
        target = _target_dtype(name, value, dtype, keep_in_fp32_modules)
        if device == "disk" and (offloads.offload_buffers or name not in offloads.buffers):
            offloads.to_disk(model, name, value, target)
        elif device == "cpu" and offloads.temp is not None:
            offloads.to_temp(model, name, value, target)
        else:  # a buffer of a "disk" module stays in memory, on the CPU
            set_module_tensor_to_device(model, name, "cpu" if device == "disk" else device, value=value, dtype=target)


def _check_offload(device_map: dict[str, Any] | None, offload_folder: Any, offload_8bit_bnb: bool) -> None:
    """Refused before anything is read: 8-bit offload, or "disk" in the map without a folder."""
    if offload_8bit_bnb:
        raise NotImplementedError(
            "load_checkpoint_in_model(offload_8bit_bnb=True) quantizes weights with bitsandbytes, which hasten does "
            "not load; load the weights unquantized"
        )
    if device_map is not None and "disk" in device_map.values():
        if offload_folder is None:
            raise ValueError(
                "At least one of the model submodule will be offloaded to disk, please pass along an `offload_folder`."
            )
        locations.refuse_url("load_checkpoint_in_model", "offload_folder", os.fspath(offload_folder))
        os.makedirs(offload_folder, exist_ok=True)


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike,
    device_map: dict[str, Any] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a checkpoint into ``model`` in place, as Accelerate's: ``checkpoint`` is one weights
    file, an ``.index.json`` of shards, or a folder with ``pytorch_model.bin``,
    ``model.safetensors`` or one index (a local path or a URL of an installed fsspec protocol,
    ``s3://bucket/model``); the shards are read one at a time. Without ``device_map``
    the tensors go where the model's are (an FSDP2 model keeps its shards; ``broadcast_from_rank0``:
    only the main process reads, the others receive); with it each goes to its module's device,
    cast to ``dtype``; "disk" modules' weights (their buffers too with ``offload_buffers``) go to
    ``offload_folder`` (required then) and stay on the meta device in the model;
    ``offload_state_dict``: the "cpu" ones wait in a temporary folder until every shard is read.
    Not ``strict`` (the default): names the model lacks are left out, with a warning; ``strict``:
    the names must match, checked before anything changes (Accelerate checks each shard alone, so
    a sharded checkpoint never passes). Tied weights are tied again after. Files are read as
    ``load_state_dict`` reads them (nothing in them runs). ``offload_8bit_bnb`` is refused."""
    from hasten.strategies.materialise import mark_filled

    _check_offload(device_map, offload_folder, offload_8bit_bnb)
    tied = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied:
        logger.warning(
            "The model weights are not tied. Please use the `tie_weights` method before using the "
            "`infer_auto_device` function."
        )
    if device_map is not None:
        check_tied_parameters_on_same_device(tied, device_map)
    paths, listed = _checkpoint_files(checkpoint)
    model_keys = set(model.state_dict())
    if strict and listed is not None:
        _check_keys(model, listed, model_keys)
    offloads = _Offloads(model, offload_folder, offload_state_dict and device_map is not None, offload_buffers)
    unexpected: set[str] = set()
    for path in paths:
        reads = not broadcast_from_rank0 or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        loaded = load_state_dict(path, device_map=device_map) if reads else {}
        if strict and listed is None:
            _check_keys(model, loaded, model_keys)
        unexpected |= set(loaded) - model_keys
        if device_map is None:
            _load_whole(model, loaded, full_state_dict, broadcast_from_rank0)
        else:
            offloads.shard(path)
            target = _as_dtype(dtype) if dtype is not None else None
            _load_mapped(model, loaded, model_keys, device_map, target, keep_in_fp32_modules, offloads)
        mark_filled(model, loaded.keys())
        del loaded
    if unexpected:
        logger.warning(
            f"Some weights of the model checkpoint at {os.fspath(checkpoint)} were not used when initializing "
            f"{type(model).__name__}: {unexpected}. This may or may not be an issue - make sure that the checkpoint "
            "does not have unnecessary parameters, or that the model definition correctly corresponds to the "
            "checkpoint."
        )
    offloads.finish(model)
    retie_parameters(model, tied)
