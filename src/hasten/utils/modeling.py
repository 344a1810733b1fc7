"""Accelerate's model helpers: ``accelerate.utils.modeling``'s ``get_mixed_precision_context_manager``
and ``get_grad_scaler`` (built on ``hasten.training.precision``), and ``accelerate.utils.other``'s
``extract_model_from_parallel``, ``is_compiled_module``, ``has_compiled_regions``,
``compile_regions`` and ``model_has_dtensor`` (built on the strategies' unwrapping and
``hasten.training.compile``), which ``hasten.utils.other`` re-exports under Accelerate's path.
"""

from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING, Any

import torch

from hasten.distributed.state import DistributedType
from hasten.training.compile import is_compiled, repeated_blocks
from hasten.training.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.handlers import AutocastKwargs

__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager"]

#: the names of ``accelerate.utils.other`` defined here (``hasten.utils.other`` re-exports them)
OTHER_NAMES = (
    "compile_regions",
    "extract_model_from_parallel",
    "has_compiled_regions",
    "is_compiled_module",
    "model_has_dtensor",
)


# --------------------------------------------------------------------------- accelerate.utils.modeling
def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> contextlib.AbstractContextManager:
    """The autocast context of the run's mixed precision, as Accelerate's: ``native_amp=False``
    is a ``nullcontext``; else, on the run's device (``AcceleratorState()``: the most recent
    Accelerator's, else what the launcher set), fp16 autocasts to float16 and bf16 and fp8 to
    bfloat16 (``hasten.training.precision``), and "no" opens ``torch.autocast`` with the device's
    default dtype (as Accelerate does). ``autocast_kwargs`` (an ``AutocastKwargs``) sets its
    ``enabled``/``cache_enabled``."""
    from hasten.settings.handlers import AutocastKwargs

    if not isinstance(native_amp, bool):
        raise TypeError(f"get_mixed_precision_context_manager: native_amp must be True or False, got {native_amp!r}")
    if autocast_kwargs is not None and not isinstance(autocast_kwargs, AutocastKwargs):
        raise TypeError(
            f"get_mixed_precision_context_manager: autocast_kwargs must be an AutocastKwargs or None, "
            f"got {autocast_kwargs!r}"
        )
    if not native_amp:
        return contextlib.nullcontext()
    from hasten.distributed.state import current_run

    state = current_run()
    if state is None:
        raise RuntimeError(
            "get_mixed_precision_context_manager reads the current run's mixed precision and device: "
            "make an Accelerator first"
        )
    handler = autocast_kwargs or AutocastKwargs()
    if state.mixed_precision == "no":  # Accelerate's: the device's own autocast dtype
        return torch.autocast(device_type=state.device.type, **handler.to_kwargs())
    return Precision(state.mixed_precision, state.device, handler).autocast()


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A ``GradScaler`` for this machine's accelerator, FSDP's ``ShardedGradScaler`` with
    ``distributed_type=DistributedType.FSDP``, as Accelerate chooses; built as a prepared run's
    (``GradScalerKwargs.build``, what ``Precision`` uses). Where there is no accelerator it is a
    CPU scaler (hasten runs fp16 on the CPU too; Accelerate would return a disabled CUDA one).
    ``kwargs`` are the scaler's (``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``enabled``), checked as ``GradScalerKwargs`` checks them."""
    from hasten.settings.handlers import GradScalerKwargs

    if distributed_type is not None:
        try:
            distributed_type = DistributedType(distributed_type)
        except ValueError:
            raise ValueError(
                f"get_grad_scaler: distributed_type must be a DistributedType or None, got {distributed_type!r}; "
                f"allowed: {', '.join(t.value for t in DistributedType)}"
            ) from None
    unknown = sorted(set(kwargs) - set(GradScalerKwargs.__dataclass_fields__))
    if unknown:
        allowed = ", ".join(GradScalerKwargs.__dataclass_fields__)
        raise TypeError(f"get_grad_scaler got unexpected arguments {unknown}; allowed: {allowed}")
    handler = GradScalerKwargs(**kwargs)
    found = torch.accelerator.current_accelerator()
    device_type = found.type if found is not None else "cpu"
    return handler.build(device_type, sharded=distributed_type == DistributedType.FSDP)  # what Precision builds


# --------------------------------------------------------------------------- accelerate.utils.other
def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``)."""
    return is_compiled(module)


def _compiled_in_place(module: torch.nn.Module) -> bool:
    """Compiled by ``nn.Module.compile()`` (hasten's regional compilation does so)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it is compiled: ``torch.compile``'s wrapper (what
    ``compile_regions`` puts in), or compiled in place by ``nn.Module.compile()`` (what a
    prepared model's regional compilation does)."""
    return any(is_compiled(m) or _compiled_in_place(m) for m in module.modules())


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Regional compilation, as Accelerate's: a new module in which each repeated block (the
    children of one class occurring more than once in a container, e.g. a transformer's layers;
    ``hasten.training.compile.repeated_blocks``) is ``torch.compile(block, **compile_kwargs)`` and
    every other part beside them (embeddings, head) is compiled on its own; the blocks share one
    compiled graph, so the cold start is one block's compile. Without repeated blocks the whole
    module is compiled. ``module`` is left as it is (the new module shares its parameters), and
    the new one keeps it as ``_orig_mod`` (what ``extract_model_from_parallel`` returns)."""
    blocks = {id(b) for b in repeated_blocks(module)}
    new = _compiled_copy(module, blocks, compile_kwargs)
    if "_orig_mod" not in new.__dict__:
        new.__dict__["_orig_mod"] = module
    return new


def _compiled_copy(module: torch.nn.Module, blocks: set[int], kwargs: dict[str, Any]) -> torch.nn.Module:
    """``module`` compiled where it is a block or holds none; else a shallow copy of it (same
    class, attributes, parameters and hooks) whose children are compiled so, one by one."""
    if id(module) in blocks or not any(id(m) in blocks for m in module.modules()):
        return torch.compile(module, **kwargs)
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update(module.__dict__)
    for name, value in list(new.__dict__.items()):  # methods bound to ``module`` bound to the copy
        if isinstance(value, types.MethodType) and value.__self__ is module:
            new.__dict__[name] = types.MethodType(value.__func__, new)
    new._modules = {}
    for name, child in module.named_children():
        new.add_module(name, _compiled_copy(child, blocks, kwargs))
    return new


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether a parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or split by tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> torch.nn.Module:
    """The user's model out of its containers (DDP, DataParallel, hasten's pipeline part, and
    ``torch.compile``'s wrapper; FSDP2 shards in place and leaves none), as Accelerate's.

    ``keep_torch_compile`` (the default): a compiled model comes back compiled (its wrapper, or a
    new one with the same settings around the unwrapped model, the original left as it is); a
    model from ``compile_regions`` comes back as it is. ``keep_fp32_wrapper=False`` removes the
    autocast forward mixed precision gave the model, for good. ``recursive``: wrappers around
    its submodules are taken off too (the submodules replaced in place).
    """
    from hasten.strategies.base import strip_wrappers
    from hasten.strategies.ddp import ddp_inner

    for name, value in (
        ("keep_fp32_wrapper", keep_fp32_wrapper),
        ("keep_torch_compile", keep_torch_compile),
        ("recursive", recursive),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"extract_model_from_parallel: {name} must be True or False, got {value!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"extract_model_from_parallel: model must be a torch.nn.Module, got {type(model).__name__}")
    regional = None
    if not is_compiled(model) and "_orig_mod" in model.__dict__ and has_compiled_regions(model):
        regional, model = model, model.__dict__["_orig_mod"]  # compile_regions' module: its original inside
    inner = strip_wrappers(model, ddp_inner)
    if recursive:
        _unwrap_children(inner, lambda m: strip_wrappers(m, ddp_inner))
    if not keep_fp32_wrapper:
        Precision.unwrap_forward(inner)
        _restore_original_forward(inner)
    if not keep_torch_compile:
        return inner
    if regional is not None:
        regional.__dict__["_orig_mod"] = inner
        return regional
    return strip_wrappers(model, ddp_inner, keep_torch_compile=True)


def _restore_original_forward(module: torch.nn.Module) -> None:
    """Accelerate's convention for a forward wrapped by hand (``convert_outputs_to_fp32``,
    ``torch.autocast``): the model keeps ``_original_forward``; the wrapper comes off for good."""
    original = module.__dict__.pop("_original_forward", None)
    if original is None or "forward" not in module.__dict__:
        return
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]  # the class's own forward again
    else:
        module.forward = original


def _unwrap_children(module: torch.nn.Module, unwrap: Any) -> None:
    """Replace each wrapped submodule of ``module`` by what ``unwrap`` finds inside it, all the way down."""
    for name, child in list(module.named_children()):
        inner = unwrap(child)
        if inner is not child:
            setattr(module, name, inner)
        _unwrap_children(inner, unwrap)
