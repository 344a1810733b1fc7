"""``accelerate.utils.operations``: the collectives and tensor helpers hasten has (homed in ``hasten.ops``)."""

from __future__ import annotations

from ..ops import (
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

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
]
