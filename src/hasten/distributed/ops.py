"""Collective operations on nested structures of tensors: gather, reduce, broadcast, pad.

Every function is a no-op (or the identity) on one process, so scripts run unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.choices import REDUCE_OPS


class DistributedOperationException(Exception):
    """A collective was called with tensors whose shapes differ across processes (debug mode).

    Accelerate's exception of the same name. Without debug mode such a call hangs or fails
    inside torch.distributed, far from the line that caused it.
    """


# Debug mode: gather, reduce and broadcast first check that every process passes the same
# shapes, and pad_across_processes the same number of dimensions (one extra collective per call).
# On with HASTEN_DEBUG_MODE=1 (or Accelerate's ACCELERATE_DEBUG_MODE), or ``PartialState().debug = True``.
_debug = [env.env_flag(env.HASTEN_DEBUG_MODE) or env.env_flag(env.ACCELERATE_DEBUG_MODE)]


def set_debug(flag: bool) -> None:
    _debug[0] = bool(flag)


def debug_mode() -> bool:
    return _debug[0]


def _verify_shapes(op: str, data: Any, ndim_only: bool = False) -> None:
    """In debug mode, raise DistributedOperationException unless every process passes alike shapes."""
    if not _debug[0] or not _distributed():
        return
    shapes = recursively_apply(lambda t: t.dim() if ndim_only else tuple(t.shape), data)
    every = gather_object([shapes])
    if any(s != every[0] for s in every):
        listed = "\n  - ".join(f"process {i}: {s}" for i, s in enumerate(every))
        what = "numbers of dimensions" if ndim_only else "shapes"
        raise DistributedOperationException(
            f"{op}: the tensors' {what} differ across processes (debug mode checks them before the collective):"
            f"\n  - {listed}"
        )


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples (named too) and mappings."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(fn, x) for k, x in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(recursively_apply(fn, x) for x in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(fn, x) for x in data)
    if hasattr(data, "to") and callable(data.to) and not isinstance(data, torch.nn.Module):
        # objects such as BatchEncoding that know how to move themselves
        return fn(data)
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``data`` (a tensor, or lists, tuples, dicts and named tuples of them, nested) with every
    tensor moved to ``device``; other values as they are."""
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


# torch 2.13 renamed all_gather_into_tensor (the old name warns); decided once here.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_tensor(op: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op} works on tensors (or nested lists/tuples/dicts of them), got {type(t).__name__}")
    return t


def gather(data: Any) -> Any:
    """Concatenate each tensor across processes along dim 0 (scalars become 1-d).

    Shapes must agree except in dim 0 across ranks only if padded first
    (see ``pad_across_processes``).
    """

    def _gather(t: torch.Tensor) -> torch.Tensor:
        t = _check_tensor("gather", t)
        if t.dim() == 0:
            t = t[None]
        if not _distributed():
            return t
        # c10d's all-gather is not differentiable; a tensor that requires grad (a loss) made gloo's
        # fallback write into views of the output that autograd refuses ("A view was created in no_grad mode")
        t = t.detach().contiguous()
        out = torch.empty((dist.get_world_size() * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t)
        return out

    _verify_shapes("gather", data)
    return recursively_apply(_gather, data)


def gather_object(obj: Any, group: Any = None) -> list[Any]:
    """A list with every process's ``obj`` (a list's items are concatenated); over ``group``
    (a process group of every process) instead of the default one where given."""
    if not _distributed():
        return list(obj) if isinstance(obj, list) else [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    if isinstance(obj, list):
        return [x for part in out for x in part]
    return out


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "none": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce each tensor across processes; every process gets the result (a new tensor).

    ``reduction``: "mean" (Accelerate's default for this function), "sum", "max", "min",
    "product", or "none", which sums without averaging, as in Accelerate. The result is then
    multiplied by ``scale``.
    """
    reduction = v.check_choice("reduce", "reduction", reduction, REDUCE_OPS)
    op = getattr(dist.ReduceOp, _REDUCE_OPS[reduction])

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        t = _check_tensor("reduce", t).clone()
        if _distributed():
            dist.all_reduce(t, op=op)
            if reduction == "mean":
                t /= dist.get_world_size()
        if scale != 1.0:
            t *= scale
        return t

    _verify_shapes("reduce", data)
    return recursively_apply(_reduce, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (in place; same shapes required)."""

    def _broadcast(t: torch.Tensor) -> torch.Tensor:
        t = _check_tensor("broadcast", t)
        if _distributed():
            dist.broadcast(t, src=from_process)
        return t

    _verify_shapes("broadcast", data)
    return recursively_apply(_broadcast, data)


def broadcast_object_list(objects: list[Any], from_process: int = 0) -> list[Any]:
    """``objects`` (picklable) replaced in place by process ``from_process``'s on every process, and
    returned (torch's ``broadcast_object_list``); with one process, ``objects`` as they are. Call it on
    every process."""
    if _distributed():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor (``torch.nested``) and returned it unpadded."""


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size across processes, so it can be gathered.

    A nested tensor has no one size along ``dim``: it is returned as it is, with a
    ``CannotPadNestedTensorWarning`` (as in Accelerate).
    """

    def _pad(t: torch.Tensor) -> torch.Tensor:
        t = _check_tensor("pad_across_processes", t)
        if t.is_nested:
            warnings.warn(
                "pad_across_processes: a nested tensor cannot be padded (its parts have different sizes); "
                "it is returned unchanged",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return t
        if not _distributed() or t.dim() == 0 or dim >= t.dim() or dim < -t.dim():
            return t
        d = dim % t.dim()
        size = torch.tensor([t.shape[d]], device=t.device)
        sizes = gather(size)
        longest = int(sizes.max())
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        idx = [slice(None)] * t.dim()
        idx[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(idx)] = t
        return out

    _verify_shapes("pad_across_processes", data, ndim_only=True)
    return recursively_apply(_pad, data)


def agree(process_index: int, what: str, fn: Callable[[], Any], share: bool = False, group: Any = None) -> Any:
    """Run ``fn`` on every process; if it failed anywhere, fail everywhere (no process hangs).

    Every process reports success or its error in one ``gather_object``; a process whose own
    ``fn`` raised re-raises it, the others raise a RuntimeError naming the process that failed.
    Returns the local result, or every process's result (in rank order) with ``share``.
    ``group``: the process group to report over (the default one where None).
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to every process below
        error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    reports = gather_object([(process_index, message, result if share else None)], group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m, _ in reports if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"{what} failed on process {r}: {m}")
    return [res for _, _, res in reports] if share else result


def from_main(is_main_process: bool, value: Any) -> Any:
    """The main process's ``value``, on every process."""
    return broadcast_object_list([value if is_main_process else None])[0]
