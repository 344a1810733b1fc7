"""The hooks that move weights and inputs between devices around a forward (Accelerate's
``AlignDevicesHook``, ``CpuOffload``, ``UserCpuOffloadHook``, ``LayerwiseCastingHook``) and the
helpers that attach them over a model (``attach_align_device_hook``,
``attach_execution_device_hook``; ``blocks.attach_align_device_hook_on_blocks`` builds on them).

An offloading ``AlignDevicesHook`` keeps its module's weights on the meta device between forwards:
before the forward each is read from the hook's ``weights_map`` (a state dict kept on the CPU, or
an ``OffloadedWeightsLoader`` over an offload folder) onto the execution device, after it they go
back to meta, so an offloaded layer holds memory only while it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hasten.big_model.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from hasten.big_model.offload import PrefixedDataset
from hasten.big_model.tensors import named_module_tensors, set_module_tensor_to_device

logger = logging.getLogger(__name__)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "UserCpuOffloadHook",
    "align_module_device",
    "attach_align_device_hook",
    "attach_execution_device_hook",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
]


def send_to_device(data: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """``data`` with its tensors (nested in lists, tuples, named tuples and mappings; an object with
    its own ``.to``) moved to ``device``; the values of a mapping under ``skip_keys`` stay put."""
    if isinstance(data, torch.Tensor) or (hasattr(data, "to") and not isinstance(data, (nn.Module, Mapping))):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to without non_blocking
            return data.to(device)
    if isinstance(data, (tuple, list)):
        moved = [send_to_device(t, device, non_blocking, skip_keys) for t in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    if isinstance(data, Mapping):
        skip = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
        return type(data)(
            {k: t if k in skip else send_to_device(t, device, non_blocking, skip_keys) for k, t in data.items()}
        )
    return data


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in ``data`` (nested), else None."""
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for item in data:
            found = find_device(item)
            if found is not None:
                return found
        return None
    return data.device if isinstance(data, torch.Tensor) else None


def _is_meta(device: Any) -> bool:
    return device == "meta" or (isinstance(device, torch.device) and device.type == "meta")


def _getattr_path(module: nn.Module, name: str) -> Any:
    for part in name.split("."):
        module = getattr(module, part)
    return module


class AlignDevicesHook(ModelHook):
    """Puts a module's inputs (and its weights) on ``execution_device`` for its forward, as
    Accelerate's. Without ``offload`` the weights are moved there once, when the hook is attached.
    With ``offload`` they stay on the meta device, read from ``weights_map`` (by default a CPU copy
    made at attach time) for each forward and dropped after it; buffers too with
    ``offload_buffers`` (else they are moved to the execution device once). ``io_same_device``:
    the output goes back to the inputs' device. ``place_submodules``: the submodules' tensors are
    handled too. ``skip_keys``: keyword arguments left where they are. ``tied_params_map`` (data
    pointer -> device -> tensor) shares one copy of a tied weight per device."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    ) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device: torch.device | None = None
        self.param_original_devices: dict[str, torch.device] = {}
        self.buffer_original_devices: dict[str, torch.device] = {}
        self.tied_params_names: set[str] = set()
        self.tied_params_map = tied_params_map
        self.tied_pointers_to_remove: set[tuple[int, Any]] = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _tensors(self, module: nn.Module, buffers: bool, persistent_only: bool = False) -> list[str]:
        found = named_module_tensors(
            module, include_buffers=buffers, recurse=self.place_submodules, remove_non_persistent=persistent_only
        )
        return [name for name, _ in found]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if _is_meta(self.execution_device):
            self.tied_params_map = None  # every meta tensor's pointer is 0
        if not self.offload:
            if self.execution_device is not None:
                for name in self._tensors(module, True):
                    set_module_tensor_to_device(
                        module, name, self.execution_device, tied_params_map=self.tied_params_map
                    )
            return module
        tensors = named_module_tensors(module, recurse=self.place_submodules)
        self.original_devices = {name: t.device for name, t in tensors}
        if self.weights_map is None:
            self.weights_map = {
                name: t.to("cpu")
                for name, t in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules
                )
            }
        for name in self._tensors(module, self.offload_buffers, persistent_only=True):
            pointer = _getattr_path(module, name).data_ptr()
            if self.tied_params_map is not None and pointer in self.tied_params_map:
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            if not self.offload_buffers:
                kept = [n for n, _ in module.named_buffers(recurse=self.place_submodules)]
            else:  # the non-persistent buffers are in no weights map: they stay, on the execution device
                kept = _non_persistent_buffers(module, self.place_submodules)
            for name in kept:
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
        return module

    def _onload(self, module: nn.Module) -> None:
        self.tied_pointers_to_remove = set()
        device = self.execution_device
        for name in self._tensors(module, self.offload_buffers, persistent_only=True):
            value = self.weights_map[name]
            tied = self.tied_params_map
            if tied is not None and name in self.tied_params_names and value.data_ptr() not in tied:
                tied[value.data_ptr()] = {}
            if tied is not None and value.data_ptr() in tied and device not in tied[value.data_ptr()]:
                self.tied_pointers_to_remove.add((value.data_ptr(), device))
            set_module_tensor_to_device(module, name, device, value=value, tied_params_map=tied)

    def _offload(self, module: nn.Module) -> None:
        for name in self._tensors(module, self.offload_buffers, persistent_only=True):
            set_module_tensor_to_device(module, name, "meta")
        for pointer, device in self.tied_pointers_to_remove:  # the tied copies made for this forward go too
            self.tied_params_map[pointer].pop(device, None)
        self.tied_pointers_to_remove = set()

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self._onload(module)
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self._offload(module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            for name, device in self.original_devices.items():
                if device != torch.device("meta"):
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name, None))
        return module


def _non_persistent_buffers(module: nn.Module, recurse: bool) -> list[str]:
    """The names of ``module``'s buffers left out of its state dict (its submodules' too with ``recurse``)."""
    if not recurse:
        return sorted(module._non_persistent_buffers_set)
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    ]


class CpuOffload(ModelHook):
    """Keeps a model on the CPU until its forward, then moves it (and the inputs) to
    ``execution_device`` (by default this process's device) and leaves it there; the model goes
    back to the CPU when ``init_hook`` runs again (``UserCpuOffloadHook.offload``). With
    ``prev_module_hook``, that model is sent back to the CPU first."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ) -> None:
        self.prev_module_hook = prev_module_hook
        self.execution_device = execution_device if execution_device is not None else _default_device()

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        previous = self.prev_module_hook
        if isinstance(previous, UserCpuOffloadHook):
            if next(previous.model.parameters()).device != torch.device("cpu"):
                previous.offload()
                _empty_cache()
        if next(module.parameters()).device == torch.device(self.execution_device):
            return args, kwargs
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _default_device() -> torch.device:
    """This process's device: the accelerator at the local rank's index where there is one, else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    found = torch.accelerator.current_accelerator()
    return torch.device(found.type, torch.accelerator.current_device_index())


def _empty_cache() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


class UserCpuOffloadHook:
    """A model with its ``CpuOffload`` hook: ``offload()`` sends the model back to the CPU,
    ``remove()`` takes the hook off."""

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


class LayerwiseCastingHook(ModelHook):
    """Stores a module's weights in ``storage_dtype`` and casts them to ``compute_dtype`` for its forward."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
) -> None:
    """An ``AlignDevicesHook(execution_device)`` on each submodule of ``module`` that has a state and
    no hook yet (not below a module of a ``preload_module_classes`` class)."""
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        hook = AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        add_hook_to_module(module, hook)
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
) -> None:
    """An ``AlignDevicesHook`` (appended to any hook there) on each submodule of ``module`` that has
    parameters or buffers of its own, its weights read from ``weights_map`` under its name
    (``module_name`` is ``module``'s). A module of a ``preload_module_classes`` class, offloaded,
    loads all its submodules' weights in its own hook."""
    whole = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if any(True for _ in named_module_tensors(module)) or whole:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=PrefixedDataset(weights_map, prefix) if weights_map is not None else None,
            offload_buffers=offload_buffers,
            place_submodules=whole,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if whole:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
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


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an offloading ``AlignDevicesHook`` (its weights on meta between forwards)."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: int | str | torch.device | None = None) -> Iterator[None]:
    """Inside the block, ``module``'s own parameters are on a device: an offloaded module's are
    loaded as for its forward (on ``execution_device`` if given) and dropped after; another
    module's are moved to ``execution_device`` (if given) and moved back after."""
    if has_offloaded_params(module):
        hook = module._hf_hook
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
        return
    if execution_device is None:
        yield
        return
    devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
    try:
        for name in devices:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict on the CPU, its offloaded weights read one module at a time (each
    module's own tensors loaded as for its forward, copied, dropped); a tensor left on meta is left
    out, with a warning naming it. The model's own tensors (not its submodules') are in it too
    (Accelerate 1.15 leaves them out)."""
    state_dict: dict[str, torch.Tensor] = {}
    placeholders: set[str] = set()
    for name, module in model.named_modules():
        with align_module_device(module, "cpu"):
            if name:
                module_state = module.state_dict()
            else:
                module_state = dict(named_module_tensors(module, remove_non_persistent=True))
        prefix = f"{name}." if name else ""
        for key, tensor in module_state.items():
            if tensor.device.type == "meta":
                placeholders.add(prefix + key)
            else:
                state_dict[prefix + key] = tensor.to("cpu")
    missing = placeholders - state_dict.keys()
    if missing:
        logger.warning(f"The following tensors were not saved because they were still on meta device: {missing}")
    return state_dict


def get_state_dict_from_offload(
    module: nn.Module,
    module_name: str,
    state_dict: dict[str, Any],
    device_to_put_offload: int | str | torch.device = "cpu",
) -> dict[str, Any]:
    """``state_dict`` with the entries of ``module`` (``module_name`` is one of its tensors' full
    name) read from it, its offloaded weights loaded onto ``device_to_put_offload``."""
    root = module_name[: module_name.rfind(".")]
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = tensor
    return state_dict
