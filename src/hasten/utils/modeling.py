"""Accelerate's model helpers.

``accelerate.utils.modeling``: ``get_mixed_precision_context_manager`` and ``get_grad_scaler``
(built on ``hasten.training.precision``), ``is_peft_model``, ``normalize_device`` and
``get_accelerator_free_memory``, defined here; and, re-exported from ``hasten.big_model``
(big-model loading), the tensor helpers (``find_tied_parameters``, ``retie_parameters``,
``set_module_tensor_to_device``, ``named_module_tensors``, ``id_tensor_storage``,
``check_tied_parameters_in_config``), the size helpers (``compute_module_sizes``,
``dtype_byte_size``, ``get_max_layer_size``, ``calculate_maximum_sizes``,
``convert_file_size_to_int``), device-map planning (``get_max_memory``, ``get_balanced_memory``,
``infer_auto_device_map``, ``check_device_map``, ``clean_device_map``) and checkpoint loading
(``load_state_dict``, ``load_checkpoint_in_model`` with device maps and disk offload, reading
through ``hasten.checkpoint``'s allow-listed unpickling).

``accelerate.utils.other``'s ``extract_model_from_parallel``, ``is_compiled_module``,
``has_compiled_regions``, ``compile_regions`` and ``model_has_dtensor`` (built on the strategies'
unwrapping and ``hasten.training.compile``), which ``hasten.utils.other`` re-exports under
Accelerate's path.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import TYPE_CHECKING, Any

import torch

from hasten.big_model.align import (
    align_module_device,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    has_offloaded_params,
)
from hasten.big_model.loading import load_checkpoint_in_model, load_state_dict
from hasten.big_model.offload import load_offloaded_weights
from hasten.big_model.planner import infer_auto_device_map
from hasten.big_model.planning import (
    check_device_map,
    check_tied_parameters_on_same_device,
    clean_device_map,
    get_balanced_memory,
    get_max_memory,
    get_module_size_with_ties,
)
from hasten.big_model.tensors import (
    calculate_maximum_sizes,
    check_tied_parameters_in_config,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_max_layer_size,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from hasten.distributed.state import DistributedType
from hasten.training.compile import is_compiled, repeated_blocks
from hasten.training.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.handlers import AutocastKwargs

__all__ = [
    "calculate_maximum_sizes",
    "check_tied_parameters_in_config",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_accelerator_free_memory",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_mixed_precision_context_manager",
    "id_tensor_storage",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_state_dict",
    "named_module_tensors",
    "normalize_device",
    "retie_parameters",
    "set_module_tensor_to_device",
]

# big-model loading (hasten.big_model): device-map planning and offloaded weights, at Accelerate's path
__all__ += [
    "align_module_device",
    "check_device_map",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_total_buffer_size",
    "get_balanced_memory",
    "get_max_memory",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "infer_auto_device_map",
    "load_offloaded_weights",
]

#: the names of ``accelerate.utils.other`` defined here (``hasten.utils.other`` re-exports them)
OTHER_NAMES = (
    "compile_regions",
    "extract_model_from_parallel",
    "has_compiled_regions",
    "is_compiled_module",
    "model_has_dtensor",
)

logger = logging.getLogger(__name__)


def normalize_device(device: Any) -> Any:
    """A device as torch takes it on this machine's accelerator (Accelerate 1.16's): ``"npu"`` is
    ``"npu:0"``; an int index is ``"<type>:<index>"`` on accelerators other than CUDA (``"hpu"`` on
    HPU), and stays an int on CUDA or without an accelerator; anything else is returned as given."""
    from hasten.utils.imports import get_torch_accelerator_backend

    if device == "npu":
        return "npu:0"
    if isinstance(device, int) and not isinstance(device, bool):
        device_type, _ = get_torch_accelerator_backend(check_available=False)  # no probe: safe under compile
        if device_type == "hpu":
            return "hpu"
        if device_type not in (None, "cuda"):
            return f"{device_type}:{device}"
    return device


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free memory in bytes of device ``device_index``, asked through ``device_module``, the API module
    ``get_torch_accelerator_backend`` returns (``torch.cuda``'s ``mem_get_info``; through
    ``torch.accelerator``, its ``get_memory_info`` where torch has it)."""
    if device_module is torch.accelerator:
        if hasattr(device_module, "get_memory_info"):
            return device_module.get_memory_info(device_index)[0]
        device = torch.accelerator.current_accelerator()
        device_module = torch.get_device_module(device)
        if device.type == "tpu":  # no mem_get_info: the total less what is allocated
            properties = device_module.get_device_properties(device_index)
            total = getattr(properties, "hbm_bytes_per_device", None) or properties.total_memory
            return max(0, int(total) - torch.accelerator.memory_allocated(device_index))
    return device_module.mem_get_info(device_index)[0]


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
    (``GradScalerKwargs.build``, what ``Precision`` uses). Where no accelerator is available it is
    an enabled CPU scaler, on a CPU build of torch and on a CUDA build without a GPU alike (hasten
    runs fp16 on the CPU too; Accelerate 1.15 returns ``torch.amp.GradScaler("cuda")`` there, which
    warns and is disabled).
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
    # An accelerator that is there, not the one torch was built for: a CUDA build of torch on a
    # machine without a GPU gets the CPU scaler too, as the CPU build does.
    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
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


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (out of its DDP/compile wrappers) is a PEFT ``PeftModel``; False where
    peft is not installed."""
    from hasten.utils.imports import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)
