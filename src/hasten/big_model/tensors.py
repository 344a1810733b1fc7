"""The tensors and sizes of a model, as Accelerate's ``accelerate.utils.modeling`` names them:
moving one tensor (``set_module_tensor_to_device``), tied weights (``find_tied_parameters``,
``retie_parameters``), and the byte counts the device-map planner works from
(``compute_module_sizes``, ``get_max_layer_size``, ``dtype_byte_size``, ``convert_file_size_to_int``).
``hasten.utils.modeling`` re-exports them at Accelerate's path."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from hasten.utils.dataclasses import CustomDtype

__all__ = [
    "calculate_maximum_sizes",
    "check_tied_parameters_in_config",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_max_layer_size",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
]


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


def get_non_persistent_buffers(module: torch.nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """The names of ``module``'s buffers that are not in its state dict (its own only unless
    ``recurse``; with ``fqns``, the submodules' by their full names, as Accelerate's)."""
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            names = sub._non_persistent_buffers_set
            found |= {f"{prefix}.{b}" for b in names} if fqns else names
    return found


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
        # ``new`` is on ``device`` already; wrapped after moving, as a ``Parameter.to`` that copies (to
        # "cpu:0" from "cpu", which diffusers' CPU offload asks for) gives a plain tensor, not a parameter
        new = type(current)(new, requires_grad=old.requires_grad)
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


def compute_module_total_buffer_size(
    model: torch.nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
) -> int:
    """Bytes of all of ``model``'s buffers, counted as ``compute_module_sizes`` counts them."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)
