"""DistributedDataParallel: the only place a DDP object is built (``apply_ddp``).

Consumes ``DistributedDataParallelKwargs``: its ``constructor_kwargs()`` are DDP's arguments and
its ``register_comm_hook(model)`` registers the communication hook, both called only here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hasten.settings.handlers import DistributedDataParallelKwargs
from hasten.strategies.base import Strategy, unwrap_compiled
from hasten.strategies.parallelize import DDPPlan

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.training.compile import Compiler
    from hasten.training.precision import Precision


def apply_ddp(
    module: torch.nn.Module,
    plan: DDPPlan,
    process_group: Any = None,
    hook: tuple[Any, Callable[..., Any]] | None = None,
    find_unused_parameters: bool | None = None,
) -> DistributedDataParallel:
    """``module`` in DDP with the handler's arguments, its communication hook registered.

    Fault tolerance (``strategies/fault_tolerance.py``) passes its own ``process_group`` (the replica
    group's), ``hook`` (``(state, hook)``: the reduction across groups, instead of the handler's) and
    ``find_unused_parameters``."""
    device_ids = list(plan.device_ids) if plan.device_ids is not None else None
    kwargs = plan.handler.constructor_kwargs()
    if find_unused_parameters is not None:
        kwargs["find_unused_parameters"] = find_unused_parameters
    model = DistributedDataParallel(
        module,
        process_group=process_group,
        **kwargs,
        device_ids=device_ids,
        output_device=device_ids[0] if device_ids else None,
    )
    if hook is None:
        plan.handler.register_comm_hook(model)
    else:
        model.register_comm_hook(*hook)
    return model


class DDPStrategy(Strategy):
    """Several processes, each with a full replica; gradients all-reduced by DDP."""

    name = "ddp"

    def __init__(
        self,
        state: ProcessState,
        precision: Precision,
        handler: DistributedDataParallelKwargs | None = None,
        compiler: Compiler | None = None,
    ) -> None:
        super().__init__(state, precision, compiler)
        self.handler = handler or DistributedDataParallelKwargs()
        device_ids = (state.device.index,) if state.device.type == "cuda" else None
        self.plan = dataclasses.replace(self.plan, ddp=DDPPlan(self.handler, device_ids))

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(unwrap_compiled(module), DistributedDataParallel):
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to synchronise (e.g. a frozen teacher model)
        if self.compiler is not None:  # the wrapped model is compiled whole: DDP's forward is traced
            _quiet_ddp_forward_range()
        return apply_ddp(module, self.plan.ddp)

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return inner.no_sync() if isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()

    def trigger_sync_in_backward(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return _forced_sync(inner) if isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()

    def _inner(self, module: torch.nn.Module) -> torch.nn.Module | None:
        return ddp_inner(module)


@contextlib.contextmanager
def _forced_sync(model: DistributedDataParallel) -> Iterator[None]:
    """DDP all-reduces in the next backward although its forward ran under ``no_sync``: the
    reducer is told to expect a backward now (torch's ``Reducer.prepare_for_backward``)."""
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved


def ddp_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a DDP wrapper holds, or None if ``module`` is not DDP."""
    return module.module if isinstance(module, DistributedDataParallel) else None


# ---------------------------------------------------------------------------- compiled DDP
class _DDPForwardRangeFilter(logging.Filter):
    """Drops Dynamo's "Profiler record function ... will be ignored" when the range is the one
    ``DistributedDataParallel.forward`` opens (torch's own, traced when the DDP-wrapped model is
    compiled): one warning per rank that the user cannot act on. Any other range in a compiled
    region (the user's own) is still reported. hasten's labels (``hasten.forward``, ...) are
    opened outside the compiled call, so they stay in the trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Profiler record function"):
            return True
        return _traced_code() is not torch.nn.parallel.DistributedDataParallel.forward.__code__


def _traced_code() -> object:
    """The code object Dynamo is tracing now (the innermost inlined function), or None: the
    translator is the ``self`` of the innermost tracer frame on this thread's stack."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    except ImportError:  # pragma: no cover - torch moved it: keep every record
        return None
    frame = sys._getframe(1)
    while frame is not None:
        tracer = frame.f_locals.get("self")
        if isinstance(tracer, InstructionTranslatorBase):
            return getattr(tracer, "f_code", None)
        frame = frame.f_back
    return None


_DDP_RANGE_FILTER = _DDPForwardRangeFilter()


def _quiet_ddp_forward_range() -> None:
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    if _DDP_RANGE_FILTER not in logger.filters:
        logger.addFilter(_DDP_RANGE_FILTER)
