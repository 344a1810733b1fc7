"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): each process takes optimizer
steps on its own, without the per-step gradient all-reduce, and every ``local_sgd_steps``
steps the model's parameters are averaged over the processes (Stich, "Local SGD Converges Fast
and Communicates Little", ICLR 2019)::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            loss = model(batch).loss
            accelerator.backward(loss)       # no all-reduce: inside no_sync
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()                 # every 8th call averages the parameters

Leaving the block averages once more, so every process ends with the same model. One
process, or ``enabled=False``: the block changes nothing (``step`` only counts). With DDP the
model's gradients stay local inside the block (``accelerator.no_sync``); FSDP is refused,
as each process holds only shards.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hasten import _validate as v
from hasten.distributed.state import DistributedType

__all__ = ["LocalSGD"]


class LocalSGD:
    """Averages ``model``'s parameters over the processes every ``local_sgd_steps`` calls of
    ``step()`` and when the ``with`` block ends; gradients are not synchronised inside it."""

    def __init__(self, accelerator: Any, model: Any, local_sgd_steps: int, enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise NotImplementedError(
                f"LocalSGD runs on one process or with DDP (MULTI_CPU, MULTI_GPU), not with {kind}: it averages whole "
                "parameters, and with FSDP each process holds only shards of them"
            )
        v.check_number("LocalSGD", "local_sgd_steps", local_sgd_steps, integer=True, ge=1)
        v.check_bool("LocalSGD", "enabled", enabled)
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._copies = accelerator._checkpointer.barrier  # the averaging waits for an async save's copy, as a step does
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._sync_and_avg_model_params()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one optimizer step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        self._copies.wait()  # an asynchronous save_state may still be copying these parameters
        self.accelerator.wait_for_everyone()
        for param in self.model.parameters():
            param.data = self.accelerator.reduce(param.data, reduction="mean")
