"""Running out of memory: ``find_executable_batch_size`` and ``release_memory`` (``hasten.utils``).

``find_executable_batch_size`` calls a training function with a batch size, and when the
function runs out of memory (CUDA, XPU or the CPU allocator) frees what can be freed and
calls it again with a smaller one, until it runs or the size reaches zero::

    from hasten.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        accelerator.free_memory()  # drop what the failed attempt prepared
        loader = DataLoader(dataset, batch_size=batch_size)
        ...

    train()  # no batch size here: the decorator passes it

Any other exception propagates at once. Importing this module imports no torch.
"""

from __future__ import annotations

import functools
import gc
import inspect
import sys
from collections.abc import Callable
from typing import Any

from hasten import _validate as v

__all__ = ["find_executable_batch_size", "is_out_of_memory", "live_tensor_bytes", "release_memory"]

# What torch's allocators say when they run out (the CPU one raises a plain RuntimeError).
# The same messages as Accelerate's ``should_reduce_batch_size``: "<DEVICE> out of memory." covers
# CUDA, HIP, XPU (and the CPU, as Accelerate's tests raise it).
_OUT_OF_MEMORY = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator running out of memory (worth a smaller batch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and len(exc.args) == 1 and any(m in str(exc.args[0]) for m in _OUT_OF_MEMORY)


def _empty_caches() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Collect garbage and empty the device caches; returns a None per object, to rebind them:
    ``model, optimizer = release_memory(model, optimizer)``."""
    count = len(objects)
    objects = ()  # drop this frame's references before collecting
    _empty_caches()
    return [None] * count


def live_tensor_bytes(device: str | None = None) -> int:
    """Bytes of every tensor this process can still reach, each storage counted once.

    Walks the objects the garbage collector tracks (parameters, buffers, optimizer state, the
    user's own tensors, and anything a library keeps), adds each tensor's ``.grad``, opens
    wrapper tensors such as ``DTensor`` to their local shards, and sums the storages by address.
    Meta and fake tensors hold no memory and count 0. ``device`` ("cpu", "cuda", ...) counts
    only storages on that device type. What this cannot see is memory no Python object refers
    to (an allocator's cache, the autograd graph between forward and backward): compare it with
    the process's RSS for that.
    """
    import torch

    seen: dict[tuple[str, int], int] = {}
    # type(), not isinstance(): isinstance reads __class__, which warns on torch.distributed.reduce_op
    stack = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    visited: set[int] = set()
    while stack:
        t = stack.pop()
        if id(t) in visited:
            continue
        visited.add(id(t))
        grad = t.grad if t.is_leaf else None
        if grad is not None:
            stack.append(grad)
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:  # a wrapper subclass (DTensor, ...): its inner tensors hold the memory
            names, _ = flatten()
            stack.extend(x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor))
            continue
        if t.is_meta or type(t).__name__ == "FakeTensor":
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor with no storage (sparse, nested, ...)
            continue
        if device is not None and storage.device.type != device:
            continue
        seen[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Decorator: call ``function(batch_size, *args, **kwargs)`` with ever smaller batch sizes
    until it does not run out of memory.

    The size starts at ``starting_batch_size`` and after each out-of-memory error becomes
    ``reduce_batch_size_fn()`` (by default 90% of the last size, rounded down). At zero a
    RuntimeError says no size fitted. A later call starts from the size that last ran, as in
    Accelerate. Used with or without arguments.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    v.check_callable("find_executable_batch_size", "function", function, optional=False)
    # 0 is accepted here and fails at the first call, as in Accelerate.
    v.check_number("find_executable_batch_size", "starting_batch_size", starting_batch_size, integer=True, ge=0)
    v.check_callable("find_executable_batch_size", "reduce_batch_size_fn", reduce_batch_size_fn)
    name = getattr(function, "__name__", "function")
    parameters = list(inspect.signature(function).parameters.values())
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    current = [starting_batch_size]  # the size to try first: the last one that ran

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        if not takes_varargs and len(parameters) < len(args) + 1:
            shown = ", ".join(map(repr, args))
            raise TypeError(
                f"{name}() got its batch size as its first argument ({name}({shown})); the decorator "
                f"find_executable_batch_size passes it: call {name}() without it"
            )
        batch_size = current[0]
        while True:
            if batch_size <= 0:
                why = (
                    "starting_batch_size=0: give a size >= 1"
                    if starting_batch_size == 0
                    else f"{name}() ran out of memory at every batch size down from {starting_batch_size}"
                )
                raise RuntimeError(f"find_executable_batch_size: No executable batch size found, reached zero. ({why})")
            try:
                current[0] = batch_size
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried
                if not is_out_of_memory(exc):
                    raise
            # Outside the except block, so the exception's frames (and the tensors they hold) can go.
            _empty_caches()
            smaller = reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)
            v.check_number("find_executable_batch_size", "reduce_batch_size_fn()", smaller, integer=True, ge=0)
            if smaller >= batch_size:
                raise ValueError(
                    f"find_executable_batch_size: reduce_batch_size_fn() must return a smaller batch size than "
                    f"{batch_size}, got {smaller}"
                )
            batch_size = smaller

    return decorator
