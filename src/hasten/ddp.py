"""Wrapping a model in DistributedDataParallel: the only place a DDP object is built.

Consumes ``DistributedDataParallelKwargs`` (whose ``build`` also registers the
communication hook).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .handlers import DistributedDataParallelKwargs
from .state import PartialState


def wrap_model(
    model: torch.nn.Module, state: PartialState, handler: DistributedDataParallelKwargs | None = None
) -> torch.nn.Module:
    """DDP-wrap ``model`` when several processes train it; otherwise return it unchanged."""
    if not state.use_distributed or isinstance(model, DistributedDataParallel):
        return model
    if not any(p.requires_grad for p in model.parameters()):
        return model  # nothing to synchronise (e.g. a frozen teacher model)
    handler = handler or DistributedDataParallelKwargs()
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    return handler.build(model, device_ids=device_ids, output_device=device_ids[0] if device_ids else None)


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
