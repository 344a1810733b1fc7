"""Weights kept out of memory, in Accelerate's offload-folder format: one raw ``<name>.dat`` file
per tensor (its bytes, C order, native byte order: what Accelerate's numpy memmaps hold) and an
``index.json`` giving each name's ``dtype`` and ``shape``; an index entry may name a
``safetensors_file`` instead (a weight read where the checkpoint already holds it).

Nothing here unpickles: a ``.dat`` file is mapped as bytes of the dtype its index names (a dtype
torch does not have, or a file of the wrong size, is refused), a safetensors file is read by
safetensors. ``hasten.utils.offload`` re-exports these names at Accelerate's path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hasten.big_model.tensors import set_module_tensor_to_device
from hasten.settings import locations

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]

INDEX_NAME = "index.json"


def _dtype_name(dtype: torch.dtype) -> str:
    """The index's name of ``dtype``: ``float32``, ``bfloat16``, ``float8_e4m3fn``, ``bool`` (numpy's
    names, which Accelerate writes; torch's are the same for every dtype both have)."""
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: Any, where: str) -> torch.dtype:
    """The torch dtype an index entry names; anything else is refused (nothing is evaluated)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: dtype {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16', 'int64')")
    return dtype


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat`` (its raw bytes; a 0-d tensor as
    one value) and, with ``index``, record its dtype and shape there; returns ``index``."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"offload_weight: weight must be a tensor, got {type(weight).__name__}")
    if weight.device.type == "meta":
        raise ValueError(f"offload_weight: {weight_name!r} is on the meta device and has no values to write")
    data = weight.detach().to("cpu").contiguous().reshape(-1)
    path = os.path.join(os.fspath(offload_folder), f"{weight_name}.dat")
    data.view(torch.uint8).numpy().tofile(path)
    if index is not None:
        index[weight_name] = {"dtype": _dtype_name(weight.dtype), "shape": list(weight.shape)}
    return index


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """The tensor ``offload_weight`` wrote to ``weight_file``, of the ``dtype`` and ``shape`` its
    index entry ``weight_info`` gives; mapped from the file (read as its pages are used)."""
    path = os.fspath(weight_file)
    shape = weight_info.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"load_offloaded_weight({path!r}): shape must be a list of sizes, got {shape!r}")
    dtype = _dtype_of(weight_info.get("dtype"), f"load_offloaded_weight({path!r})")
    count = math.prod(shape) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    found = os.path.getsize(path)
    if found != count * itemsize:
        raise ValueError(
            f"load_offloaded_weight({path!r}): the file holds {found} bytes, its index entry "
            f"({weight_info.get('dtype')}, shape {list(shape)}) needs {count * itemsize}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(path, shared=False, size=count, dtype=dtype).reshape(shape)


def save_offload_index(index: dict[str, Any] | None, offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (made if missing); nothing for an empty index."""
    if not index:
        return
    path = os.path.join(os.fspath(offload_folder), INDEX_NAME)
    current: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            current = json.load(f)
    current.update(index)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=2)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` (made if missing) with its ``index.json``."""
    locations.refuse_url("offload_state_dict", "save_dir", os.fspath(save_dir))  # a local folder, never "s3:"
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


def load_offloaded_weights(model: Any, index: Mapping[str, Any] | None, offload_folder: str | os.PathLike) -> None:
    """Put back on the CPU, into ``model``, each weight ``index`` lists from ``offload_folder``'s
    ``.dat`` files (nothing for an empty index; bitsandbytes' ``SCB`` statistics are skipped)."""
    if not index:
        return
    for name, info in index.items():
        if "SCB" in name:
            continue
        weight = load_offloaded_weight(os.path.join(os.fspath(offload_folder), f"{name}.dat"), info)
        set_module_tensor_to_device(model, name, "cpu", value=weight)


class PrefixedDataset(Mapping):
    """A view of ``dataset`` (a mapping with string keys) under ``prefix``: ``view[key]`` is
    ``dataset[prefix + key]``. As Accelerate's, iterating gives the full keys that start with
    the prefix, and ``len`` is the whole dataset's."""

    def __init__(self, dataset: Mapping, prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)


class OffloadedWeightsLoader(Mapping):
    """The weights of a model by name, from ``state_dict`` (tensors in memory, first) or from an
    offload folder: ``save_folder``'s ``.dat`` files, described by ``index`` (by default the
    folder's ``index.json``); an index entry with a ``safetensors_file`` is read from that file
    (its ``weight_name``, else the key; cast to its ``dtype`` if it gives one). Each weight is
    read when asked for, onto ``device`` (the CPU by default) for safetensors entries."""

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, Any] | None = None,
        device: Any = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            with open(os.path.join(os.fspath(save_folder), INDEX_NAME), encoding="utf-8") as f:
                index = json.load(f)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            return self._from_safetensors(key, info)
        if self.save_folder is None:
            raise KeyError(f"{key!r} is offloaded to a .dat file, but this loader has no save_folder")
        return load_offloaded_weight(os.path.join(os.fspath(self.save_folder), f"{key}.dat"), info)

    def _from_safetensors(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        from safetensors import safe_open

        device = "cpu" if self.device is None else self.device
        with safe_open(info["safetensors_file"], framework="pt", device="cpu") as f:
            tensor = f.get_tensor(info.get("weight_name", key))
        if "dtype" in info:
            tensor = tensor.to(_dtype_of(info["dtype"], f"OffloadedWeightsLoader[{key!r}]"))
        return tensor.to(device) if tensor.device != torch.device(device) else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def extract_submodules_state_dict(state_dict: dict[str, Any], submodule_names: list[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` that belong to the modules ``submodule_names``: the name
    itself or ``name.*`` (``h.1`` takes ``h.1.weight``, not ``h.10.weight``)."""
    result: dict[str, Any] = {}
    for module in submodule_names:
        result.update({k: t for k, t in state_dict.items() if k == module or k.startswith(module + ".")})
    return result
