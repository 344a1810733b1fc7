"""The DDP communication hook table: plain, fp16/bf16 compression, PowerSGD, and wrappers.

``DistributedDataParallelKwargs.register_comm_hook(model)`` (the handler's translation, called by
``strategies/ddp.py``) is its one caller: it lives beside the handler, below the strategies.

torch's own fp16/bf16 hooks and wrappers are used on NCCL. On other backends (gloo) torch's
bf16 hooks are documented for NCCL only, so hasten supplies its own compression hook and
wrapper, written against ``torch.distributed.all_reduce`` (gloo reduces fp16 and bf16
tensors), and uses them for both dtypes there so that every hook x wrapper combination
behaves the same on every backend.

No ``from __future__ import annotations`` here: DDP checks that a hook's ``bucket``
annotation is the real ``dist.GradBucket`` class.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from hasten.settings.choices import DDPCommunicationHookType
from hasten.settings.dtypes import DTYPES

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def compress_hook(dtype: torch.dtype) -> Hook:
    """All-reduce a bucket in ``dtype`` (averaged), then copy back in place."""

    def hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


def compress_wrapper(dtype: torch.dtype, inner: Hook) -> Hook:
    """Run ``inner`` on a ``dtype`` copy of the bucket, then cast the result back."""

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = inner(state, bucket)

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            original.copy_(value[0] if isinstance(value, list) else value)
            return original

        return fut.then(decompress)

    wrapped.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_wrapper({getattr(inner, '__name__', 'hook')})"
    return wrapped


def in_bucket_order(inner: Hook) -> Hook:
    """Run ``inner`` on one bucket at a time, in DDP's bucket order.

    PowerSGD chains collectives from future callbacks (all-reduce P, then Q, per bucket).
    Gloo matches collectives by the order each rank issues them, and with two or more
    buckets those callbacks interleave differently on different ranks: the ranks then
    exchange the wrong tensors ("Received data size doesn't match") or wait forever. Here
    a bucket's hook starts only when the previous bucket's result is ready, so every rank
    issues the same collectives in the same order. (NCCL needs no such help.)
    """

    previous: list[torch.futures.Future] = []

    def ordered(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def finish(fut: torch.futures.Future) -> None:
            try:
                result.set_result(fut.value())
            except BaseException as exc:  # noqa: BLE001 - handed to DDP, which raises it
                result.set_exception(exc)

        def launch(_: Any = None) -> None:
            try:
                inner(state, bucket).add_done_callback(finish)
            except BaseException as exc:  # noqa: BLE001 - handed to DDP, which raises it
                result.set_exception(exc)

        before = previous[0] if previous else None
        previous[:] = [result]
        if before is None:
            launch()
        else:  # runs at once if the previous bucket is already done
            before.add_done_callback(launch)
        return result

    ordered.__name__ = ordered.__qualname__ = f"in_bucket_order({getattr(inner, '__name__', 'hook')})"
    return ordered


_batched_fixed = False


def _fix_batched_powersgd() -> None:
    """Let torch's batched PowerSGD hook run on torch versions where it cannot.

    Some torch releases (2.13 among them) made ``_orthogonalize`` accept only a batch of
    matrices (3-d) while ``batched_powerSGD_hook`` still hands it single 2-d matrices, so the
    hook fails with a bare AssertionError on its first compressed step. Where that is so,
    2-d input is viewed as a batch of one (in place, as the hook expects). Probed once.
    """
    global _batched_fixed
    if _batched_fixed:
        return
    _batched_fixed = True
    original = powerSGD_hook._orthogonalize
    try:
        original(torch.ones(2, 1))
        return  # this torch handles 2-d matrices itself
    except AssertionError:
        pass

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    powerSGD_hook._orthogonalize = orthogonalize


def resolve_hook(
    hook: DDPCommunicationHookType | str,
    wrapper: DDPCommunicationHookType | str,
    state_option: dict[str, Any],
    process_group: dist.ProcessGroup | None,
    backend: str,
) -> tuple[Any, Hook] | None:
    """The (state, hook) pair to register, or None for DDP's built-in all-reduce."""
    hook = DDPCommunicationHookType(hook)
    wrapper = DDPCommunicationHookType(wrapper)
    if hook is DDPCommunicationHookType.NO and wrapper is DDPCommunicationHookType.NO:
        return None
    on_nccl = backend == "nccl"

    state: Any
    fn: Hook
    if hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
        state = powerSGD_hook.PowerSGDState(process_group=process_group, **state_option)
        if hook is DDPCommunicationHookType.BATCHED_POWER_SGD:
            _fix_batched_powersgd()
        fn = (
            powerSGD_hook.powerSGD_hook
            if hook is DDPCommunicationHookType.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
    elif hook in (DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16):
        state = process_group
        if on_nccl:
            fn = default_hooks.fp16_compress_hook if hook.value == "fp16" else default_hooks.bf16_compress_hook
        else:
            fn = compress_hook(DTYPES[hook.value])
    else:
        state = process_group
        fn = default_hooks.allreduce_hook

    if wrapper is not DDPCommunicationHookType.NO:
        if on_nccl:
            torch_wrapper = (
                default_hooks.fp16_compress_wrapper if wrapper.value == "fp16" else default_hooks.bf16_compress_wrapper
            )
            fn = torch_wrapper(fn)
        else:
            fn = compress_wrapper(DTYPES[wrapper.value], fn)
    if not on_nccl and isinstance(state, powerSGD_hook.PowerSGDState):
        fn = in_bucket_order(fn)
    return state, fn


def register_comm_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    hook: DDPCommunicationHookType | str,
    wrapper: DDPCommunicationHookType | str,
    state_option: dict[str, Any],
) -> None:
    """Register the chosen hook (and wrapper) on a DDP model; nothing for the defaults."""
    process_group = model.process_group
    resolved = resolve_hook(hook, wrapper, state_option, process_group, dist.get_backend(process_group))
    if resolved is not None:
        model.register_comm_hook(*resolved)
