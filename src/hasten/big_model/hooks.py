"""Accelerate's module hooks (``accelerate.hooks``): callbacks around a module's ``forward`` that
also see its keyword arguments.

``add_hook_to_module(module, hook)`` replaces ``module.forward`` with one that runs
``hook.pre_forward`` (which may change the arguments), the original forward (under
``torch.no_grad()`` when ``hook.no_grad``) and ``hook.post_forward`` (which may change the
output); the original is kept as ``module._old_forward`` and the hook as ``module._hf_hook``, the
attributes transformers, PEFT and diffusers read. A second hook replaces the first, or with
``append=True`` chains after it (a ``SequentialHook``). ``remove_hook_from_module`` restores the
forward. These are Accelerate's semantics, attribute for attribute.

The hooks that move weights between devices (``AlignDevicesHook``, ``CpuOffload``,
``UserCpuOffloadHook``, ``LayerwiseCastingHook``) and the ``attach_*`` helpers are in
``hasten.big_model.align`` and ``hasten.big_model.blocks``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]


class ModelHook:
    """Callbacks run around a module's forward (attach with :func:`add_hook_to_module`).

    ``no_grad`` (class attribute, default False): run the module's forward under ``torch.no_grad()``.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is attached; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run before the forward; returns the (possibly changed) ``args`` and ``kwargs``."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Run after the forward; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Run when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks, run in order at each event."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
    if module._hf_hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return module._hf_hook.post_forward(module, output)


def _graph_module(module: nn.Module) -> bool:
    # torch.fx's GraphModuleImpl: its forward is set on the class (an instance forward freezes the graph)
    return "GraphModuleImpl" in str(type(module))


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (in place; the module is returned). A hook already there is
    replaced, or with ``append=True`` chained before the new one in a :class:`SequentialHook`."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"add_hook_to_module: module must be a torch.nn.Module, got {type(module).__name__}")
    missing = [m for m in ("init_hook", "pre_forward", "post_forward", "detach_hook") if not hasattr(hook, m)]
    if missing:  # a ModelHook, or an object with its four methods (as Accelerate calls them)
        raise TypeError(f"add_hook_to_module: hook must be a ModelHook, got {type(hook).__name__} without {missing}")
    if append and getattr(module, "_hf_hook", None) is not None:
        old_hook = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward  # a hook is there already: the new one replaces it
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), old_forward)
    if _graph_module(module):
        module.__class__.forward = forward
    else:
        module.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and of every submodule with ``recurse``) and restore its
    forward (in place; the module is returned). A module without a hook is left as it is."""
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if _graph_module(module):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    # the attributes Accelerate's dispatch_model adds are marked so
    added = [name for name, value in module.__dict__.items() if getattr(value, "_accelerate_added_attribute", False)]
    for name in added:
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach the hooks of ``module`` and of all its submodules."""
    remove_hook_from_module(module)
    for child in module.children():
        remove_hook_from_submodules(child)
