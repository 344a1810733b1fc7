"""Accelerate's model helpers.

``accelerate.utils.modeling``: ``get_mixed_precision_context_manager`` and ``get_grad_scaler``
(built on ``hasten.training.precision``); the tensor helpers (``find_tied_parameters``,
``retie_parameters``, ``set_module_tensor_to_device``, ``named_module_tensors``,
``id_tensor_storage``, ``check_tied_parameters_in_config``, ``is_peft_model``); the size helpers
(``compute_module_sizes``, ``dtype_byte_size``, ``get_max_layer_size``, ``calculate_maximum_sizes``,
``convert_file_size_to_int``); and checkpoint loading (``load_state_dict``,
``load_checkpoint_in_model``, reading through ``hasten.checkpoint``'s allow-listed unpickling).

``accelerate.utils.other``'s ``extract_model_from_parallel``, ``is_compiled_module``,
``has_compiled_regions``, ``compile_regions`` and ``model_has_dtensor`` (built on the strategies'
unwrapping and ``hasten.training.compile``), which ``hasten.utils.other`` re-exports under
Accelerate's path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from hasten.distributed.state import DistributedType
from hasten.training.compile import is_compiled, repeated_blocks
from hasten.training.precision import Precision
from hasten.utils.dataclasses import CustomDtype

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.handlers import AutocastKwargs

__all__ = [
    "calculate_maximum_sizes",
    "check_tied_parameters_in_config",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_mixed_precision_context_manager",
    "id_tensor_storage",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
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


# --------------------------------------------------------------------------- accelerate.utils.modeling: tensors
def _module_and_name(module: torch.nn.Module, tensor_name: str) -> tuple[torch.nn.Module, str]:
    """The module holding ``tensor_name`` (a dotted name) and the tensor's own name there."""
    *path, name = tensor_name.split(".")
    for part in path:
        child = getattr(module, part)
        if child is None:
            raise ValueError(f"{module} has no attribute {part}.")
        module = child
    return module, name


def named_module_tensors(
    module: torch.nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s parameters, then (``include_buffers``) its buffers, as ``(name, tensor)``;
    its own only unless ``recurse``. ``remove_non_persistent`` leaves out the buffers that are
    not in the state dict (matched by their own name, as Accelerate does)."""
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped: set[str] = set()
    if remove_non_persistent:
        skipped = set(module._non_persistent_buffers_set)
        if recurse:
            for sub in module.modules():
                skipped |= sub._non_persistent_buffers_set
    for name, buffer in module.named_buffers(recurse=recurse):
        if name not in skipped:
            yield name, buffer


def _same_device(first: torch.device, second: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device (torch's ``==`` says they differ)."""
    if first.type != second.type:
        return False
    fill = lambda d: torch.device(d.type, 0) if d.type != "cpu" and d.index is None else d  # noqa: E731
    return fill(first) == fill(second)


def _keeps_dtype(t: torch.Tensor) -> bool:
    """Integer and bool tensors keep their dtype when a ``dtype`` is asked for."""
    return str(t.dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


def set_module_tensor_to_device(
    module: torch.nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` (dotted) of ``module`` on ``device``, or set
    it to ``value`` there, in place of the old one (a parameter stays a parameter of its class,
    with its ``requires_grad``), as Accelerate's. ``value`` is cast to the old tensor's dtype, or
    to ``dtype`` (integer and bool values keep theirs); its shape must be the old one's. A tensor
    on the meta device needs a ``value`` to go elsewhere. ``tied_params_map`` (data pointer ->
    device -> tensor) reuses a tied weight already put on the device. ``fp16_statistics`` (8-bit
    bitsandbytes weights) are refused: hasten does not load 8-bit models."""
    if fp16_statistics is not None:
        raise NotImplementedError(
            "set_module_tensor_to_device(fp16_statistics=...) sets bitsandbytes 8-bit statistics, which hasten "
            "does not load; load the model's weights unquantized"
        )
    owner, name = _module_and_name(module, tensor_name)
    if name not in owner._parameters and name not in owner._buffers:
        raise ValueError(f"{owner} does not have a parameter or a buffer named {name}.")
    is_buffer = name in owner._buffers
    old = getattr(owner, name)
    if tied_params_map is not None:
        for key in ([value.data_ptr()] if value is not None else []) + [old.data_ptr()]:
            if key in tied_params_map and device in tied_params_map[key]:
                owner._parameters[name] = tied_params_map[key][device]
                return
    if old.device.type == "meta" and str(device) != "meta" and value is None:
        raise ValueError(f"{name} is on the meta device, we need a `value` to put in on {device}.")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if value is not None:
        if old.shape != value.shape:
            raise ValueError(
                f'Trying to set a tensor of shape {value.shape} in "{name}" (which has shape {old.shape}), this '
                "looks incorrect."
            )
        if dtype is None:
            value = value.to(old.dtype, non_blocking=non_blocking)
        elif not _keeps_dtype(value):
            value = value.to(dtype, non_blocking=non_blocking)
    with torch.no_grad():
        new = _moved(owner, name, old, device, value, dtype, is_buffer, non_blocking)
    if clear_cache and str(device) not in ("cpu", "meta") and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if tied_params_map is not None:
        for key in [old.data_ptr()] + ([value.data_ptr()] if value is not None else []):
            if key in tied_params_map and device not in tied_params_map[key]:
                tied_params_map[key][device] = new
                break


def _moved(
    owner: torch.nn.Module,
    name: str,
    old: torch.Tensor,
    device: Any,
    value: Any,
    dtype: torch.dtype | None,
    is_buffer: bool,
    non_blocking: bool,
) -> torch.Tensor:
    """``set_module_tensor_to_device``'s move: the new tensor, set in ``owner``."""
    param_cls = type(owner._parameters[name]) if not is_buffer else None
    if value is None:
        new = old.to(device, non_blocking=non_blocking)
        if dtype is not None and str(device) == "meta":
            if not _keeps_dtype(old):
                new = new.to(dtype, non_blocking=non_blocking)
            if not is_buffer:
                owner._parameters[name] = param_cls(new, requires_grad=old.requires_grad)
    elif isinstance(value, torch.Tensor):
        new = value.to(device, non_blocking=non_blocking)
    else:
        new = torch.tensor(value, device=device)
    if is_buffer:
        owner._buffers[name] = new
        return new
    current = owner._parameters[name]
    if value is not None or not _same_device(torch.device(device), current.device):
        hf_initialized = current.__dict__.get("_is_hf_initialized")
        new = type(current)(new, requires_grad=old.requires_grad).to(device, non_blocking=non_blocking)
        if hf_initialized is not None:
            new._is_hf_initialized = hf_initialized
        owner._parameters[name] = new
    return owner._parameters[name]


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, storage pointer, storage bytes)``: equal for tensors sharing one storage
    (views, tied weights); every meta tensor's pointer is 0 (they share no data)."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except Exception:  # a tensor without a storage of its own
        return tensor.device, 0, tensor.nelement() * tensor.element_size()


def find_tied_parameters(model: torch.nn.Module, **kwargs: Any) -> list[list[str]]:
    """The groups of parameter names that are one parameter (tied weights), each sorted, e.g.
    ``[['embed.weight', 'head.weight']]``, as Accelerate's (``kwargs`` are accepted and ignored,
    as there). Groups come in the order of their first name in ``model.named_parameters()``."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(set(names)) for names in groups.values() if len(set(names)) > 1]


def _get(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, Any]:
    owner, attr = _module_and_name(model, name)
    return owner, attr, getattr(owner, attr)


def retie_parameters(model: torch.nn.Module, tied_params: list[list[str]]) -> None:
    """Tie again each group of ``tied_params`` (as ``find_tied_parameters`` gives them) whose link
    was broken: every name becomes the first of the group's parameters not on the meta device
    (a group all on meta is left as it is)."""
    for group in tied_params:
        chosen = next((p for p in (_get(model, n)[2] for n in group) if p.device.type != "meta"), None)
        if chosen is None:
            continue
        for name in group:
            owner, attr, _ = _get(model, name)
            setattr(owner, attr, chosen)


def check_tied_parameters_in_config(model: torch.nn.Module) -> bool:
    """Whether a transformers model says some of its weights should be tied (its config's
    ``tie_word_embeddings`` with output embeddings, ``tie_encoder_decoder``, or a module with
    ``_tie_weights``); False for any other model."""
    if "PreTrainedModel" not in [c.__name__ for c in type(model).__mro__]:
        return False
    config = getattr(model, "config", None)
    decoder = None
    if config is not None:
        decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    tied_words = bool(
        decoder is not None and getattr(decoder, "tie_word_embeddings", False) and model.get_output_embeddings()
    )
    tied_encoder = bool(
        config is not None
        and getattr(config, "is_encoder_decoder", False)
        and getattr(config, "tie_encoder_decoder", False)
    )
    return tied_words or tied_encoder or any(hasattr(m, "_tie_weights") for m in model.modules())


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (out of its DDP/compile wrappers) is a PEFT ``PeftModel``; False where
    peft is not installed."""
    from hasten.utils.imports import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


# --------------------------------------------------------------------------- accelerate.utils.modeling: sizes
def dtype_byte_size(dtype: torch.dtype | CustomDtype) -> float:
    """Bytes one value of ``dtype`` takes: 4 for float32, 1/8 for bool, 1 for the float8 types
    and ``CustomDtype.FP8``, 1/2 and 1/4 for ``CustomDtype.INT4``/``INT2``."""
    sizes = {torch.bool: 1 / 8, CustomDtype.INT2: 1 / 4, CustomDtype.INT4: 1 / 2, CustomDtype.FP8: 1}
    if dtype in sizes:
        return sizes[dtype]
    if str(dtype).startswith("torch.float8_"):
        return 1
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(bits.group(1)) // 8


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float16"``, ``"torch.float16"`` or a dtype: the dtype."""
    return getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype


def compute_module_sizes(
    model: torch.nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes of every submodule's parameters and buffers, by module name (``""``: the whole
    model), as Accelerate counts them: with ``dtype`` each floating tensor counted at the smaller
    of its size and ``dtype``'s (integer and bool tensors at their own), ``special_dtypes`` (tensor
    name -> dtype) overriding; ``buffers_only`` counts buffers alone. A defaultdict(int)."""
    size = dtype_byte_size(_as_dtype(dtype)) if dtype is not None else None
    special = {k: dtype_byte_size(_as_dtype(d)) for k, d in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            nbytes = tensor.numel() * special[name]
        elif size is None or _keeps_dtype(tensor):
            nbytes = tensor.numel() * dtype_byte_size(tensor.dtype)
        else:
            nbytes = tensor.numel() * min(size, dtype_byte_size(tensor.dtype))
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += nbytes
    return sizes


def get_max_layer_size(
    modules: list[tuple[str, torch.nn.Module]], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """The largest size of one layer among ``modules`` (named), and the names of the layers that
    size: a layer is a module without children, or one whose class is in ``no_split_module_classes``
    (parameters and buffers given in ``modules`` count as layers). Sizes from ``compute_module_sizes``."""
    best, names = 0, []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        children = list(module.named_children()) if isinstance(module, torch.nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            queue = [(f"{name}.{n}", m) for n, m in children] + queue
    return best, names


def calculate_maximum_sizes(model: torch.nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total bytes, (bytes of the largest layer, its names))``: the model's size and its
    largest unsplittable layer (a transformers model's ``_no_split_modules`` kept whole)."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(top, sizes, no_split)


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes from an int or a string with a unit: ``"1MiB"`` is 1048576, ``"5MB"`` 5000000,
    ``"5Mb"`` (bits) 625000, as Accelerate reads them."""
    error = (
        f"`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit (like '5.0GB')."
    )
    result = -1
    try:
        if isinstance(size, int):
            result = size
        elif isinstance(size, str):
            upper = size.upper()
            for unit, factor in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10)):
                if upper.endswith(unit):
                    result = int(float(size[:-3]) * factor)
                    break
            else:
                for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
                    if upper.endswith(unit):
                        result = int(float(size[:-2]) * factor)
                        result = result // 8 if size.endswith("b") else result
                        break
    except ValueError:
        raise ValueError(error) from None
    if result < 0:
        raise ValueError(error)
    return result


# --------------------------------------------------------------------------- accelerate.utils.modeling: loading
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


def _refuse_offload(device_map: dict[str, Any] | None, offload_state_dict: bool, offload_8bit_bnb: bool) -> None:
    """Offloading to disk is big-model inference's, which hasten does not have."""
    asked = [
        what
        for what, given in (
            ('device_map with "disk"', device_map is not None and "disk" in device_map.values()),
            ("offload_state_dict=True", offload_state_dict),
            ("offload_8bit_bnb=True", offload_8bit_bnb),
        )
        if given
    ]
    if asked:
        raise NotImplementedError(
            f"load_checkpoint_in_model: {' and '.join(asked)} offloads weights to disk, big-model inference, which "
            "hasten does not have; load the weights in memory (device_map without 'disk'), or shard the model "
            "with FSDP2 (FullyShardedDataParallelPlugin) and load it with accelerator.load_model"
        )


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


def _load_mapped(
    model: torch.nn.Module,
    loaded: dict[str, Any],
    model_keys: set[str],
    device_map: dict[str, Any],
    dtype: torch.dtype | None,
    keep_in_fp32_modules: list[str] | None,
) -> None:
    """One file's tensors, each put on its module's device by ``device_map`` (cast to ``dtype``,
    fp32 kept for ``keep_in_fp32_modules`` under fp16), as Accelerate does."""
    for name, value in loaded.items():
        if "SCB" in name or name not in model_keys:
            continue  # bitsandbytes' statistics; names the model does not have
        module = name
        while module and module not in device_map:
            module = module.rpartition(".")[0]
        if module == "" and "" not in device_map:
            raise ValueError(f"{name} doesn't have any device set.")
        target = dtype
        if dtype == torch.float16 and value.is_floating_point() and keep_in_fp32_modules:
            if any((k in name and k + "." in name) or k == name for k in keep_in_fp32_modules):
                target = torch.float32
        set_module_tensor_to_device(
            model, name, device_map[module], value=value, dtype=target if value.is_floating_point() else None
        )


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
    cast to ``dtype``. Not ``strict`` (the default): names the model lacks are left out, with a
    warning; ``strict``: the names must match, checked before anything changes (Accelerate checks
    each shard alone, so a sharded checkpoint never passes). Tied weights are tied again after.
    Files are read as ``load_state_dict`` reads them (nothing in them runs). Offloading to disk
    (``"disk"`` in ``device_map``, ``offload_state_dict``, ``offload_8bit_bnb``) is refused."""
    from hasten.strategies.materialise import mark_filled

    _refuse_offload(device_map, offload_state_dict, offload_8bit_bnb)
    tied = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied:
        logger.warning(
            "The model weights are not tied. Please use the `tie_weights` method before using the "
            "`infer_auto_device` function."
        )
    paths, listed = _checkpoint_files(checkpoint)
    model_keys = set(model.state_dict())
    if strict and listed is not None:
        _check_keys(model, listed, model_keys)
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
            target = _as_dtype(dtype) if dtype is not None else None
            _load_mapped(model, loaded, model_keys, device_map, target, keep_in_fp32_modules)
        mark_filled(model, loaded.keys())
        del loaded
    if unexpected:
        logger.warning(
            f"Some weights of the model checkpoint at {os.fspath(checkpoint)} were not used when initializing "
            f"{type(model).__name__}: {unexpected}. This may or may not be an issue - make sure that the checkpoint "
            "does not have unnecessary parameters, or that the model definition correctly corresponds to the "
            "checkpoint."
        )
    retie_parameters(model, tied)
