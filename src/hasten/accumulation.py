"""The LR scheduler of ``GradientAccumulationPlugin(adjust_scheduler=True)``.

``AcceleratedScheduler`` (optim.py) steps a scheduler once per real optimizer step. With
``adjust_scheduler`` the schedule counts batches instead (as a script without accumulation
writes it): at each real optimizer step the scheduler advances by the micro-steps of the
cycle that step ended (``num_steps``, or fewer for a short last cycle of an epoch).
Chosen once, at ``prepare`` time; the plain scheduler is used otherwise.
"""

from __future__ import annotations

from typing import Any

from .optim import AcceleratedOptimizer, AcceleratedScheduler
from .state import GradientState


class MicroStepScheduler(AcceleratedScheduler):
    """An AcceleratedScheduler that advances once per micro-step of each completed cycle."""

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        step_with_optimizer: bool,
        gradient_state: GradientState,
    ) -> None:
        super().__init__(scheduler, optimizers, step_with_optimizer)
        self.gradient_state = gradient_state

    def step(self, *args: Any, **kwargs: Any) -> None:
        seen = self._seen
        super().step(*args, **kwargs)  # steps once when the optimizers took a real step
        if self._seen > seen:
            for _ in range(self.gradient_state.cycle_micro_steps - 1):
                self.scheduler.step(*args, **kwargs)
