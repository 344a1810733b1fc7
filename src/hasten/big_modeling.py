"""Accelerate's ``accelerate.big_modeling``: building a model without its memory
(``init_empty_weights``, ``init_on_device``, defined here) and placing a model bigger than memory
over accelerators, the CPU and the disk (``dispatch_model``, ``cpu_offload``,
``cpu_offload_with_hook``, ``disk_offload``, ``load_checkpoint_and_dispatch``; in
``hasten.big_model``, docs: *Models bigger than memory*).

A model built inside ``init_empty_weights()`` has its parameters on the meta device (no memory,
no initialisation work); its buffers stay real unless ``include_buffers=True``, so computed
buffers (a RoPE ``inv_freq``) keep their values. Prepared with FSDP2
(``FullyShardedDataParallelPlugin``), such a model is sharded on meta and only each process's
shards are allocated, then initialised or loaded (README, *Models bigger than one device*)::

    with init_empty_weights():
        model = Transformer(config)
    model = accelerator.prepare(model)
    accelerator.load_model(model, "weights/")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hasten.big_model.dispatch import (  # big-model loading: dispatch by device map, CPU and disk offload
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
)
from hasten.big_model.planning import check_device_map  # Accelerate's big_modeling imports it (transformers patches it)

__all__ = [
    "check_device_map",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
]


@contextlib.contextmanager
def init_on_device(device: Any, include_buffers: bool = False) -> Iterator[None]:
    """Inside the block, every parameter a module registers is created on ``device`` (and
    every buffer too with ``include_buffers``)."""
    import torch
    from torch import nn

    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            # the same class (a Parameter subclass keeps its attributes); only the data moves
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to(device), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_empty_weights(include_buffers: bool | None = None) -> contextlib.AbstractContextManager:
    """Build models inside the block with their parameters on the meta device (buffers too with
    ``include_buffers=True``; Accelerate's ``ACCELERATE_INIT_INCLUDE_BUFFERS`` is read when it
    is None)."""
    if include_buffers is None:
        from hasten.settings import environment as env

        include_buffers = env.env_flag(env.ACCELERATE_INIT_INCLUDE_BUFFERS)
    return init_on_device("meta", include_buffers=include_buffers)
