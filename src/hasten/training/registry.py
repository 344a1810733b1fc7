"""What ``prepare()`` returned, in order, by kind: the one record of an Accelerator's objects.

Checkpoints (hasten.checkpoint) and the profiler (hasten.training.profiling) read the prepared objects
from here, passed to them explicitly, and nowhere else. The lists are in preparation order,
which is the order checkpoints store them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hasten.training.optimizer import real_steps

if TYPE_CHECKING:  # pragma: no cover
    from hasten.data_loader.core import PreparedDataLoader
    from hasten.training.optimizer import AcceleratedOptimizer
    from hasten.training.scheduler import AcceleratedScheduler


@dataclass
class PreparedObjects:
    """An Accelerator's prepared models, optimizers, schedulers, dataloaders and the objects
    registered with ``register_for_checkpointing``."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[PreparedDataLoader] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many objects of each kind (what a checkpoint must hold as many of)."""
        return {
            "models": len(self.models),
            "optimizers": len(self.optimizers),
            "schedulers": len(self.schedulers),
            "dataloaders": len(self.dataloaders),
            "custom_objects": len(self.custom_objects),
        }

    def optimizers_of(self, target: Any) -> list[AcceleratedOptimizer]:
        """The prepared optimizers that are ``target`` or wrap it (a scheduler's optimizer)."""
        return [o for o in self.optimizers if o is target or o.optimizer is target]

    def real_steps(self) -> int:
        """Optimizer steps that changed the weights, counted by the slowest prepared optimizer."""
        return real_steps(self.optimizers)

    def sync_steps(self) -> int:
        """``step()`` calls with synchronised gradients (fp16-skipped ones included), the largest count."""
        return max((o.sync_steps for o in self.optimizers), default=0)

    def clear(self, *, custom_objects: bool = False) -> None:
        """Forget the prepared objects (the registered ones too with ``custom_objects``)."""
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()
        if custom_objects:
            self.custom_objects.clear()
