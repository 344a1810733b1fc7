"""``attach_align_device_hook_on_blocks``: the hooks of a dispatched model, block by block of its
device map (what ``dispatch_model`` attaches), as Accelerate attaches them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hasten.big_model.align import AlignDevicesHook, attach_align_device_hook, attach_execution_device_hook
from hasten.big_model.hooks import add_hook_to_module

__all__ = ["attach_align_device_hook_on_blocks"]


def _one_setting(
    module: nn.Module, execution_device: Any, offload: bool, weights_map: Any, offload_buffers: bool, **rest: Any
) -> None:
    """One device (and one offload choice) for the whole module."""
    if not offload:
        hook = AlignDevicesHook(
            execution_device=execution_device,
            io_same_device=True,
            skip_keys=rest["skip_keys"],
            place_submodules=True,
            tied_params_map=rest["tied_params_map"],
        )
        add_hook_to_module(module, hook)
        return
    attach_align_device_hook(
        module,
        execution_device=execution_device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        module_name=rest["module_name"],
        skip_keys=rest["skip_keys"],
        tied_params_map=rest["tied_params_map"],
    )


def _block(
    module: nn.Module, name: str, device: Any, offload: bool, weights_map: Any, buffers: bool, **rest: Any
) -> None:
    """The hooks of ``name``, one block of the device map: on its device whole, or offloaded."""
    skip, tied, preload = rest["skip_keys"], rest["tied_params_map"], rest["preload_module_classes"]
    if not offload:
        hook = AlignDevicesHook(
            execution_device=device,
            offload_buffers=buffers,
            io_same_device=name == "",
            place_submodules=True,
            skip_keys=skip,
            tied_params_map=tied,
        )
        add_hook_to_module(module, hook)
        attach_execution_device_hook(module, device, skip_keys=skip, tied_params_map=tied)
        return
    attach_align_device_hook(
        module,
        execution_device=device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=buffers,
        module_name=name,
        skip_keys=skip,
        preload_module_classes=preload,
        tied_params_map=tied,
    )
    if not hasattr(module, "_hf_hook"):
        hook = AlignDevicesHook(
            execution_device=device, io_same_device=name == "", skip_keys=skip, tied_params_map=tied
        )
        add_hook_to_module(module, hook)
    attach_execution_device_hook(module, device, preload_module_classes=preload, skip_keys=skip, tied_params_map=tied)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: int | str | torch.device | Mapping[str, Any] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
) -> None:
    """Hooks for ``module`` by blocks: ``execution_device`` and ``offload`` are one value for the
    whole module, or mappings from block (module) name to value, as a device map gives them. A
    block kept on its device gets one hook that moves it there whole; an offloaded block gets a
    hook on each of its submodules that loads their weights from ``weights_map`` for their
    forward. The root (``""``) returns outputs on the inputs' device."""
    rest = {
        "skip_keys": skip_keys,
        "tied_params_map": tied_params_map,
        "preload_module_classes": preload_module_classes,
        "module_name": module_name,
    }
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        _one_setting(module, execution_device, offload, weights_map, offload_buffers, **rest)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, offload)
    if module_name in execution_device and module_name in offload:
        device = execution_device[module_name]
        _block(module, module_name, device, offload[module_name], weights_map, offload_buffers, **rest)
    elif module_name == "":
        hook = AlignDevicesHook(
            execution_device=execution_device.get(""),
            io_same_device=True,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook)
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )
