"""Placing a model across devices, as Accelerate's ``accelerate.big_modeling`` does:
``dispatch_model`` (by a device map: accelerators, "cpu", "disk"), ``cpu_offload`` and
``disk_offload`` (the whole model kept off the execution device, each layer brought there for its
forward), ``cpu_offload_with_hook`` (the model moved to the device for its forward and left there
until the next model's turn) and ``load_checkpoint_and_dispatch`` (load, then dispatch).

Offloaded weights stay on the meta device between forwards; ``disk`` weights are read from the
offload folder (raw ``.dat`` files or the checkpoint's safetensors, never unpickled).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch import nn

from hasten.big_model.align import AlignDevicesHook, CpuOffload, UserCpuOffloadHook, attach_align_device_hook
from hasten.big_model.blocks import attach_align_device_hook_on_blocks
from hasten.big_model.hooks import add_hook_to_module
from hasten.big_model.loading import load_checkpoint_in_model
from hasten.big_model.offload import (
    INDEX_NAME,
    OffloadedWeightsLoader,
    extract_submodules_state_dict,
    offload_state_dict,
)
from hasten.big_model.planner import infer_auto_device_map
from hasten.big_model.planning import check_device_map, get_balanced_memory
from hasten.big_model.tensors import find_tied_parameters, retie_parameters

__all__ = ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch"]

logger = logging.getLogger(__name__)

#: the strings ``load_checkpoint_and_dispatch`` takes for ``device_map``
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _first_device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters())).device


def cpu_offload(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep one copy of ``model``'s weights on the CPU (``state_dict``, by default its own state
    dict copied there) and its parameters on the meta device; each module's are put on
    ``execution_device`` (by default where the model's first parameter is) for its forward, then
    dropped. Outputs come back on the inputs' device. Returns ``model``, hooked in place."""
    if execution_device is None:
        execution_device = _first_device(model)
    if state_dict is None:
        state_dict = {n: t.to("cpu") for n, t in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=state_dict,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until its forward, which moves it to ``execution_device`` where it
    stays until the returned hook's ``offload()`` (or the forward of a model given this hook as its
    ``prev_module_hook``) sends it back: for pipelines that run models in turn."""
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Write ``model``'s weights to ``offload_dir`` (unless an ``index.json`` is there already:
    they were offloaded before) and keep its parameters on the meta device; each module's are
    read from the folder onto ``execution_device`` for its forward, then dropped."""
    if not os.path.isfile(os.path.join(os.fspath(offload_dir), INDEX_NAME)):
        offload_state_dict(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = _first_device(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=OffloadedWeightsLoader(save_folder=offload_dir),
        preload_module_classes=preload_module_classes,
    )
    return model


def _warn_on_move(method: Any, model: nn.Module) -> Any:
    """``model.to``/``.cuda`` of a dispatched model: a warning, and refused where weights are offloaded."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        text = "You shouldn't move a model that is dispatched using accelerate hooks."
        if method.__name__ != "to" or torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            logger.warning(text)
        if any(p.device.type == "meta" for p in model.parameters()):
            raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk.")
        return method(*args, **kwargs)

    wrapper._accelerate_added_attribute = True
    return wrapper


def _weights_map(model: nn.Module, device_map: dict[str, Any], main_device: Any, **given: Any) -> Any:
    """Where the offloaded blocks' weights are read from: the CPU blocks' state dict, the offload
    folder (written now from the model if it has no ``index.json``) or the index given."""
    state_dict, offload_dir, offload_index = given["state_dict"], given["offload_dir"], given["offload_index"]
    if main_device != "cpu":
        cpu_blocks = [name for name, device in device_map.items() if device == "cpu"]
        if state_dict is None and cpu_blocks:
            state_dict = extract_submodules_state_dict(model.state_dict(), cpu_blocks)
    disk_blocks = [name for name, device in device_map.items() if device == "disk"]
    if disk_blocks and offload_dir is None and offload_index is None:
        raise ValueError(
            "We need an `offload_dir` to dispatch this model according to this `device_map`, the following submodules "
            f"need to be offloaded: {', '.join(disk_blocks)}."
        )
    if disk_blocks and offload_index is None and not os.path.isfile(os.path.join(os.fspath(offload_dir), INDEX_NAME)):
        offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_blocks))
    save_folder = offload_dir if disk_blocks else None
    if state_dict is None and save_folder is None and offload_index is None:
        return None
    return OffloadedWeightsLoader(
        state_dict=state_dict,
        save_folder=save_folder,
        index=offload_index,
        device=main_device if offload_index is not None else None,
    )


def _tied_params_map(model: nn.Module, tied: list[list[str]]) -> dict[int, dict[Any, torch.Tensor]]:
    """One entry per tied weight that holds values (data pointer -> device -> its copy there)."""
    found: dict[int, dict[Any, torch.Tensor]] = {}
    for group in tied:
        for name in group:
            tensor = model.get_parameter(name)
            if tensor.device.type != "meta":
                found[tensor.data_ptr()] = {}
    return found


def dispatch_model(
    model: nn.Module,
    device_map: dict[str, int | str | torch.device],
    main_device: int | str | torch.device | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: dict[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model`` by ``device_map`` (module name -> accelerator id, "cpu" or "disk"), as
    Accelerate does: with one device (and no ``force_hooks``) the model is simply moved there;
    else each block gets hooks that run it on its device (offloaded blocks: on ``main_device``,
    by default the first accelerator of the map, else the CPU), "disk" blocks read from
    ``offload_dir`` (or ``offload_index``), "cpu" blocks from ``state_dict`` when the main device
    is an accelerator. Sets ``model.hf_device_map``; returns ``model``."""
    check_device_map(model, device_map)
    devices = set(device_map.values())
    if len(devices) > 1 or "disk" in devices or force_hooks:
        if main_device is None:
            on_device = devices - {"cpu", "disk"}
            main_device = next(iter(on_device)) if on_device else "cpu"
        weights_map = _weights_map(
            model, device_map, main_device, state_dict=state_dict, offload_dir=offload_dir, offload_index=offload_index
        )
        execution_device = {n: main_device if d in ("cpu", "disk") else d for n, d in device_map.items()}
        execution_device[""] = main_device
        offloaded = ("disk",) if main_device in ("cpu", "mps") else ("cpu", "disk")
        tied = find_tied_parameters(model)
        attach_align_device_hook_on_blocks(
            model,
            execution_device=execution_device,
            offload={n: d in offloaded for n, d in device_map.items()},
            offload_buffers=offload_buffers,
            weights_map=weights_map,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=_tied_params_map(model, tied),
        )
        where = " and ".join(d for d in devices if d in ("cpu", "disk"))
        if where:
            logger.warning(f"Some parameters are on the meta device because they were offloaded to the {where}.")
        retie_parameters(model, tied)
        model.to = _warn_on_move(model.to, model)
        if torch.cuda.is_available():
            model.cuda = _warn_on_move(model.cuda, model)
    else:
        model.to(next(iter(devices)))
    model.hf_device_map = dict(device_map)
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | dict[str, int | str | torch.device] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (``load_checkpoint_in_model``) and dispatch it
    (``dispatch_model``) by ``device_map``: a map, or "auto"/"balanced"/"balanced_low_0" (budgets
    from ``get_balanced_memory``) or "sequential" (``max_memory`` as given), planned by
    ``infer_auto_device_map``. Without ``device_map`` the model is only loaded. A map with "disk"
    offloads the CPU part of the state dict to a temporary folder while loading unless
    ``offload_state_dict=False``."""
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        raise ValueError(
            "If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or 'sequential'."
        )
    if isinstance(device_map, str):
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
        )
    if offload_state_dict is None and device_map is not None and "disk" in device_map.values():
        offload_state_dict = True
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )
