"""The LR-scheduler wrapper (``accelerate.scheduler``): steps on its optimizers' real steps.

A scheduler steps as Accelerate's does: not on accumulation micro-steps (``sync_gradients``
False), not after a skipped fp16 step (``step_was_skipped`` of one of its optimizers), else
``num_processes`` times (each process consumed that many batches' worth of the schedule)
unless batches are split (``split_batches=True``); a scheduler with ``total_steps``
(OneCycleLR) is never stepped past it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hasten.training.optimizer import AcceleratedOptimizer


class AcceleratedScheduler:
    """Steps the wrapped LR scheduler on the real steps of its optimizer(s).

    ``steps_per_step`` scheduler steps per optimizer step: the number of processes, or 1 with
    split batches (Accelerate's rule). With ``step_with_optimizer=False`` every ``step()``
    steps the scheduler once.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
    ):
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"AcceleratedScheduler.num_processes must be an integer >= 1, got {num_processes!r}")
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.steps_per_step = 1 if split_batches else num_processes
        # OneCycleLR's total_steps, decided once here rather than looked up on every step
        self._total_steps: int | None = getattr(scheduler, "total_steps", None)
        self._gradient_state = optimizers[0].gradient_state if optimizers else None

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer or self._gradient_state is None:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._gradient_state.sync_gradients:  # an accumulation micro-step: the optimizer did not step
            return
        for optimizer in self.optimizers:
            if optimizer._is_overflow:  # the fp16 step was skipped: so is the schedule's
                return
        total = self._total_steps
        for _ in range(self.steps_per_step):
            # OneCycleLR raises once stepped past total_steps (a last short epoch can get there).
            if total is not None and getattr(self.scheduler, "_step_count", 0) > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: defer to the wrapped scheduler.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
