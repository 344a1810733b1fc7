"""Device-map planning, as Accelerate's ``accelerate.utils.modeling`` plans: the memory budgets
(``get_max_memory``, ``get_balanced_memory``), the checks of a map (``check_device_map``,
``clean_device_map``) and the pieces ``planner.infer_auto_device_map`` is built from.

It is arithmetic on the sizes ``compute_module_sizes`` counts, so a model on the meta device
plans as well as a real one, and budgets of accelerators this machine does not have (integer
ids) plan the same maps as on a machine that has them.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from hasten.big_model.tensors import (
    compute_module_sizes,
    convert_file_size_to_int,
)

__all__ = [
    "check_device_map",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "fallback_allocate",
    "get_balanced_memory",
    "get_max_memory",
    "get_module_leaves",
    "get_module_size_with_ties",
]

logger = logging.getLogger(__name__)

#: the devices a budget may name besides integer accelerator ids, in the order they are filled
NAMED_DEVICES = ("mps", "cpu", "disk")


def _accelerator() -> tuple[str | None, Any]:
    """This machine's accelerator type and its torch module (``None, None`` without one)."""
    if not torch.accelerator.is_available():
        return None, None
    found = torch.accelerator.current_accelerator()
    return found.type, torch.get_device_module(found)


def _available_ram() -> int:
    """Bytes of host memory available to this process now (``MemAvailable`` on Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _measured_memory(device_type: str | None, module: Any) -> dict[int | str, int]:
    """Free memory of each accelerator and the host's available memory (``max_memory=None``)."""
    found: dict[int | str, int] = {}
    count = module.device_count() if device_type not in (None, "mps") else 0
    for i in range(count):
        try:
            torch.tensor(0, device=f"{device_type}:{i}")
            found[i] = module.mem_get_info(i)[0]
        except Exception as error:  # a device that cannot be asked is left out, as Accelerate does
            logger.info(f"Could not determine memory for {device_type}:{i}: {error}")
    found["mps" if device_type == "mps" else "cpu"] = _available_ram()
    return found


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """The memory budget of each device, in bytes: without ``max_memory``, each accelerator's free
    memory and the host's available memory ("cpu"); with it, its sizes read (``"10GiB"``,
    ``"500MB"``, an int) and its devices ordered as they are filled: accelerator ids ascending, then
    "mps", "cpu", "disk". A device that is none of these is refused; an id this machine lacks is
    kept (with a warning), so budgets plan the same on any machine. ``max_memory`` is left as it is."""
    device_type, module = _accelerator()
    if max_memory is None:
        return _measured_memory(device_type, module)
    if not isinstance(max_memory, dict):
        raise TypeError(f"get_max_memory: max_memory must be a dict of device -> size or None, got {max_memory!r}")
    read: dict[int | str, int] = {}
    for key, value in max_memory.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"get_max_memory: max_memory[{key!r}] must be bytes or a size like '2GiB', got {value!r}")
        read[key] = convert_file_size_to_int(value) if isinstance(value, str) else value
    ids = sorted(k for k in read if isinstance(k, int) and not isinstance(k, bool))
    present = list(range(module.device_count())) if device_type not in (None, "mps") else []
    for i in ids:
        if i not in present:
            logger.warning(f"Device {i} is not available, available devices are {present}")
    ordered = ids + [k for k in NAMED_DEVICES if k in read]
    unknown = [k for k in read if k not in ordered]
    if unknown:
        raise ValueError(
            f"get_max_memory: device {unknown[0]!r} is not recognized, available devices are integers (for "
            "GPU/XPU), 'mps', 'cpu' and 'disk'"
        )
    return {k: read[k] for k in ordered}


def _no_split_list(no_split_module_classes: Any) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """The names in ``module_sizes`` that no other name there is directly under (``""`` left out)."""
    children: dict[str, int] = {}
    for name in module_sizes:
        if name and "." in name:
            parent = name.rsplit(".", 1)[0]
            children[parent] = children.get(parent, 0) + 1
    return [name for name in module_sizes if name and not children.get(name, 0)]


def _no_split_buffer(model: nn.Module, sizes: dict[str, int], no_split: list[str]) -> int:
    """The size of the first module found of each no-split class, the largest of them."""
    first: dict[str, int] = {}
    for name, size in sizes.items():
        if not name:
            continue
        cls = type(model.get_submodule(name) if _is_module_name(model, name) else None).__name__
        if cls in no_split and cls not in first:
            first[cls] = size
        if set(first) == set(no_split):
            break
    return max(first.values()) if first else 0


def _is_module_name(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A ``max_memory`` for ``infer_auto_device_map`` that spreads the model evenly over the
    accelerators, as Accelerate's: each but the last gets the model's size over their number plus a
    margin (1.25 × the larger of the largest no-split block and the mean leaf module), the last
    keeps its whole budget; ``low_zero`` puts on accelerator 0 only what the others cannot hold.
    Without accelerators in the budget it is ``get_max_memory(max_memory)``. With one accelerator
    and no ``max_memory``, 90% of its free memory."""
    measured = max_memory is None
    max_memory = get_max_memory(max_memory)
    device_type, _ = _accelerator()
    count = len(
        [
            d
            for d, m in max_memory.items()
            if m > 0 and (isinstance(d, int) or (d not in ("cpu", "disk") and torch.device(d).type == device_type))
        ]
    )
    if count == 0:
        return max_memory
    if count == 1:
        low_zero = False
        if measured:
            first = next((k for k in max_memory if isinstance(k, int)), None)
            if first is not None:
                max_memory[first] *= 0.9  # the rest for activations
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_device = sizes[""] // (count - 1 if low_zero else count)
    no_split = _no_split_list(no_split_module_classes)
    buffer = _no_split_buffer(model, sizes, no_split) if no_split else 0
    leaves = set(get_module_leaves(sizes))  # the tensors
    modules = {n: v for n, v in sizes.items() if n not in leaves}
    final = get_module_leaves(modules)  # the modules holding them
    mean = int(sum(modules[n] for n in final) / max(len(final), 1))
    per_device += int(1.25 * max(buffer, mean))
    ids = sorted(d for d, m in max_memory.items() if isinstance(d, int) and m > 0)
    for i in ids[:-1]:
        max_memory[i] = min(max_memory[0] if low_zero and i == 0 else per_device, max_memory[i])
    if low_zero:
        max_memory[0] = min(max(0, sizes[""] - sum(max_memory[i] for i in ids[1:])), max_memory[0])
    return max_memory


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge, in place, the entries under each module that all go to one device into one entry
    for that module (``{"a.0": 0, "a.1": 0}`` becomes ``{"a": 0}``); returns ``device_map``."""
    prefix = f"{module_name}." if module_name else ""
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(values) > 1 and len(set(values)) == 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    below = [k for k in device_map if k.startswith(prefix) and len(k) > len(module_name)]
    children = {".".join(k.split(".")[:depth]) for k in below}
    for child in children:
        clean_device_map(device_map, module_name=child)
    return device_map


def check_device_map(model: nn.Module, device_map: dict[str, Any]) -> None:
    """Refuse a ``device_map`` that leaves a tensor of ``model``'s state dict without a device
    (naming them); keys that are no module of ``model`` are warned about."""
    modules = dict(model.named_modules())
    invalid = [k for k in device_map if k != "" and k not in modules]
    if invalid:
        warnings.warn(
            f"The following device_map keys do not match any submodules in the model: {invalid}",
            UserWarning,
            stacklevel=2,
        )
    if "" in device_map:
        return
    left = [name for name in model.state_dict() if not any(name == m or name.startswith(m + ".") for m in device_map)]
    if left:
        raise ValueError(
            f"The device_map provided does not give any device for the following parameters: {', '.join(left)}"
        )


def _param_device(name: str, device_map: dict[str, Any]) -> Any:
    while name not in device_map:
        if not name:
            raise ValueError("The `device_map` does not contain the module .")
        name = name.rpartition(".")[0]
    return device_map[name]


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: dict[str, Any]) -> None:
    """Warn where one group of tied parameters is sent to several devices by ``device_map``."""
    for group in tied_params:
        devices = {p: _param_device(p, device_map) for p in group}
        if len(set(devices.values())) > 1:
            logger.warning(
                f"Tied parameters are on different devices: {devices}. Please modify your custom device map or set "
                "`device_map='auto'`. "
            )


def _outside_ties(name: str, tied_parameters: list[list[str]]) -> list[str]:
    """The tied parameters outside ``name`` of the groups with one member inside it and one outside
    (Accelerate's test: ``name + "."`` found in ``param + "."``)."""
    inside = lambda p: name + "." in p + "."  # noqa: E731
    groups = [g for g in tied_parameters if any(inside(p) for p in g) and not all(inside(p) for p in g)]
    return [p for g in groups for p in g if not inside(p)]


def get_module_size_with_ties(
    tied_params: list[str], module_size: int, module_sizes: dict[str, int], modules_to_treat: list[tuple[str, Any]]
) -> tuple[int, list[str], list[Any]]:
    """``module_size`` plus the modules (among ``modules_to_treat``) holding ``tied_params``, less
    the tied parameters themselves (counted once); with those modules' names and the modules."""
    if not tied_params:
        return module_size, [], []
    names, modules = [], []
    for param in tied_params:
        found = [(n, m) for n, m in modules_to_treat if param == n or param.startswith(n + ".")]
        if not found:
            raise ValueError(
                f"infer_auto_device_map: the module holding the tied parameter {param!r} was already placed"
            )
        names.append(found[0][0])
        modules.append(found[0][1])
    total = module_size + sum(module_sizes[n] - module_sizes[p] for p, n in zip(tied_params, names))
    return total, names, modules


def _children(module: Any, no_split: list[str]) -> list[tuple[str, Any]]:
    """What splitting ``module`` gives (its own parameters, then its children), or [] where it
    cannot be split (a tensor, a module without children, a no-split class)."""
    if not isinstance(module, nn.Module):
        return []
    children = list(module.named_children())
    if not children or type(module).__name__ in no_split:
        return []
    return list(module.named_parameters(recurse=False)) + children


def fallback_allocate(
    modules: list[tuple[str, Any]],
    module_sizes: dict[str, int],
    size_limit: int | str,
    no_split_module_classes: list[str] | None = None,
    tied_parameters: list[list[str]] | None = None,
) -> tuple[str | None, Any, list[tuple[str, Any]]]:
    """The first module (breadth-first through ``modules``, splitting where allowed) whose size
    with its ties fits ``size_limit``: ``(name, module, modules without it)`` (its parents in
    ``modules`` replaced by their parts), else ``(None, None, modules)``."""
    try:
        size_limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = no_split_module_classes or []
    search = list(modules)
    while search:
        name, module = search.pop(0)
        with_ties, _, _ = get_module_size_with_ties(
            _outside_ties(name, tied_parameters or []), module_sizes[name], module_sizes, search
        )
        if with_ties <= size_limit:
            return (name, *_take(modules, name))
        parts = _children(module, no_split)
        search = [(f"{name}.{n}", v) for n, v in parts] + search
    return None, None, modules


def _take(modules: list[tuple[str, Any]], name: str) -> tuple[Any, list[tuple[str, Any]]]:
    """``name``'s module out of ``modules``, each of its ancestors there replaced by its parts first."""
    for i, char in enumerate(name):
        if char != ".":
            continue
        names = [n for n, _ in modules]
        parent = name[:i]
        if parent in names:
            at = names.index(parent)
            parent_module = modules[at][1]
            parts = list(parent_module.named_parameters(recurse=False)) + list(parent_module.named_children())
            modules = modules[:at] + [(f"{parent}.{n}", v) for n, v in parts] + modules[at + 1 :]
    at = [n for n, _ in modules].index(name)
    module = modules[at][1]
    return module, modules[:at] + modules[at + 1 :]
