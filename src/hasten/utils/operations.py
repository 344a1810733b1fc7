"""``accelerate.utils.operations``: the collectives (homed in ``hasten.distributed.ops``) and
Accelerate's helpers for nested structures of tensors (lists, tuples, named tuples, mappings).

``recursively_apply`` here is Accelerate's, with its ``test_type`` and ``error_on_other_type``;
``hasten.distributed.ops.recursively_apply`` is the collectives' own (tensors only).
``GatheredParameters`` is Accelerate's DeepSpeed ZeRO-3 gathering context, which does nothing
without ZeRO-3: in hasten (which never runs DeepSpeed) it never does anything.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import update_wrapper
from typing import Any

import torch

from hasten import _validate as v
from hasten.distributed.ops import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from hasten.utils.dataclasses import TensorInformation

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "GatheredParameters",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "get_data_structure",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor`` (Accelerate's helper)."""
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a ``TensorInformation`` (a tensor's shape and dtype, as
    ``find_device``/``send_to_device`` pass them between processes)."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a named tuple (a tuple with ``_asdict`` and ``_fields``)."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """``generator``'s items as a container of ``obj``'s type (a list, tuple or named tuple)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``func(leaf, *args, **kwargs)`` for every leaf of the nested lists, tuples and mappings in
    ``data`` for which ``test_type(leaf)`` holds; the same structure back (each container rebuilt
    as its own type). Other leaves are kept as they are, or, with ``error_on_other_type``, a
    TypeError naming their type."""
    if isinstance(data, (tuple, list, Mapping)):

        def inner(o: Any) -> Any:
            return recursively_apply(
                func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
            )

        if isinstance(data, (tuple, list)):
            return honor_type(data, (inner(o) for o in data))
        return type(data)({k: inner(o) for k, o in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` "
            "should be passed."
        )
    return data


def get_data_structure(data: Any) -> Any:
    """``data`` with each tensor replaced by its ``TensorInformation`` (shape and dtype)."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors of the shapes and dtypes a ``get_data_structure`` result records."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure, test_type=is_tensor_information
    )


def find_batch_size(data: Any) -> int:
    """The size of the first dimension of the first tensor found (depth first) in ``data``.

    An empty container is a ValueError, a leaf that is not a tensor a TypeError (as in Accelerate).
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from empty {type(data)}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors but got {type(data)}.")
    if data.dim() == 0:
        raise TypeError("Can only find the batch size of tensors with at least one dimension, got a 0-d tensor.")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """``find_batch_size``, or None where it raises."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """``data`` with each tensor replaced by its values as (nested) Python numbers (``tolist``;
    bfloat16 read as float32)."""

    def _to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.to(torch.float32)
        return tensor.tolist()

    return recursively_apply(_to_list, data)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """``tensor[tensor_slice]`` of each tensor in ``data`` (``process_index`` and ``num_processes``
    are accepted and unused, as in Accelerate)."""
    return recursively_apply(lambda t, s: t[s], data, tensor_slice)


def concatenate(data: Any, dim: int = 0) -> Any:
    """``torch.cat`` of a list of alike structures of tensors, structure by structure along ``dim``
    (a list holding one non-tensor item gives that item back)."""
    if not isinstance(data, (tuple, list)) or len(data) == 0:
        raise ValueError(
            f"concatenate.data must be a non-empty list or tuple of tensors (or of alike structures of them), "
            f"got {v.shown(data)}"
        )
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"Can only concatenate tensors but got {type(first)}")


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad each tensor along ``dim`` with zeros to ``batch_size`` rounded up to a multiple of
    ``num_processes``, so every process gets a share (Accelerate's, for splitting a batch).

    Accelerate's arithmetic misses the multiple for some sizes (9 rows on 4 processes give 11
    there, an even 8 on 2 become 10); hasten pads to the multiple and leaves a tensor that is one
    already as it is.
    """
    v.check_number("pad_input_tensors", "batch_size", batch_size, integer=True, ge=1)
    v.check_number("pad_input_tensors", "num_processes", num_processes, integer=True, ge=1)
    v.check_number("pad_input_tensors", "dim", dim, integer=True)
    target = -(-batch_size // num_processes) * num_processes

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"pad_input_tensors.dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
        rows = t.shape[dim]
        if rows == target:
            return t
        if rows > target:
            raise ValueError(
                f"pad_input_tensors: a tensor has {rows} rows along dim {dim}, more than batch_size={batch_size} "
                f"padded for num_processes={num_processes} ({target})"
            )
        shape = list(t.shape)
        shape[dim] = target
        out = t.new_zeros(shape)
        out.narrow(dim, 0, rows).copy_(t)
        return out

    return recursively_apply(_pad, tensor, error_on_other_type=True)


def _is_low_precision(tensor: Any) -> bool:
    return (is_torch_tensor(tensor) or hasattr(tensor, "dtype")) and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """``tensor`` (nested) with every float16 and bfloat16 tensor cast to float32."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_low_precision)


class ConvertOutputsToFp32:
    """A forward whose float16/bfloat16 outputs come back as float32 (``convert_outputs_to_fp32``);
    it refuses to be pickled, as Accelerate's (unwrap the model first)."""

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        raise pickle.PicklingError(
            "Cannot pickle a prepared model with automatic mixed precision, please unwrap the model with "
            "`Accelerator.unwrap_model(model)` before pickling it."
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` with its float16/bfloat16 outputs cast to float32. The returned function's
    ``__wrapped__`` leads back to ``model_forward`` (``inspect.unwrap``), as in Accelerate."""
    v.check_callable("convert_outputs_to_fp32", "model_forward", model_forward, optional=False)
    wrapped = ConvertOutputsToFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    forward.__wrapped__ = wrapped  # type: ignore[attr-defined]
    return forward


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (nested lists, tuples, mappings), else None."""
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for obj in data:
            device = find_device(obj)
            if device is not None:
                return device
        return None
    return data.device if isinstance(data, torch.Tensor) else None


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 - Accelerate's name
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Iterator[None]:
    """Accelerate's wrapper of DeepSpeed's ZeRO-3 ``GatheredParameters``, a no-op context without
    ZeRO-3, so always one in hasten (which runs no DeepSpeed: FSDP2's parameters are gathered by
    its own hooks, and ``model.state_dict()`` or ``accelerator.get_state_dict`` gives whole ones)."""
    yield


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor one process holds, on every process (on each one's device): the others pass
    None and need not know its shape or dtype, as in Accelerate (``broadcast`` needs both).
    Accelerate sums what it gets, so where several processes pass a tensor, all get their sum."""
    from hasten.distributed.state import ProcessState

    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices: tensor must be a torch.Tensor or None, got {type(tensor).__name__}")
    device = ProcessState().device
    facts = gather_object([None if tensor is None else (tuple(tensor.shape), tensor.dtype)])
    given = [f for f in facts if f is not None]
    if not given:
        raise ValueError("copy_tensor_to_devices: every process passed None; one of them must pass the tensor")
    shape, dtype = given[0]
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
    return reduce(tensor.to(device), reduction="sum")
