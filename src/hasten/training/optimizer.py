"""The optimizer wrapper aware of loss scaling and gradient accumulation (``accelerate.optimizer``).

Rules:
- ``optimizer.step()`` and ``zero_grad()`` act only on steps that synchronise gradients
  (the last micro-step of an accumulation cycle); in between they are no-ops.
- With fp16 the step goes through the GradScaler; a step skipped for inf/nan gradients is
  reported by ``step_was_skipped``.
- Every attribute the wrapper does not define itself is the wrapped optimizer's (read through
  ``__getattr__``, so looked up only where the wrapper has no attribute of that name: no cost on
  the step): a custom optimizer's methods and fields, and ``train()``/``eval()`` of schedule-free
  optimizers, which the wrapper defines (as Accelerate's does) so that they wait for an
  asynchronous save still copying the weights they change. Writes go to the wrapped optimizer for
  ``state``, ``param_groups`` and ``defaults`` (Accelerate's); any other attribute set on the
  wrapper stays the wrapper's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hasten.distributed.state import LoopState
from hasten.training.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.barrier import CopyBarrier


def real_steps(optimizers: list[AcceleratedOptimizer]) -> int:
    """Steps that changed the weights, as counted by the slowest of ``optimizers`` (0 for none)."""
    return min((o.real_steps for o in optimizers), default=0)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; behaves like it (param_groups, state, state_dict...)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        gradient_state: LoopState,
        copies: CopyBarrier | None = None,
    ):
        # Deliberately no super().__init__: every attribute is the wrapped optimizer's.
        self.optimizer = optimizer
        self.precision = precision
        self.gradient_state = gradient_state
        # The Accelerator's asynchronous saves still copying the weights and this state (``copies``,
        # given at prepare): a step waits for them before it changes anything. ``_in_flight`` is
        # the barrier's own list (empty with nothing in flight), so the step tests one attribute.
        self._copies = copies
        self._in_flight: list[Any] = copies.events if copies is not None else []
        # With fp16: whether the scaler ran the step, known without an extra device sync.
        self._stepped = precision.track_steps(optimizer)
        self._is_overflow = False  # the last synchronised step was skipped (fp16 inf/nan); Accelerate's name
        self.real_steps = 0  # optimizer steps that really changed the weights
        self.sync_steps = 0  # step() calls with synchronised gradients (fp16-skipped ones included)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped because of inf/nan gradients (fp16)."""
        return self._is_overflow

    # ---------------------------------------------------------------- delegation
    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._in_flight:
            self._copies.wait()  # type: ignore[union-attr] - a list that is not empty is the barrier's
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        """An attribute the wrapper lacks: the wrapped optimizer's (only called after normal lookup failed)."""
        optimizer = self.__dict__.get("optimizer")  # absent while unpickling: no recursion through __getattr__
        if optimizer is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(optimizer, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, nor has the {type(optimizer).__name__} "
                "it wraps"
            ) from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.optimizer)))

    # ---------------------------------------------------------------- schedule-free modes
    def train(self) -> None:
        """Put the optimizer in "train" mode (schedule-free optimizers: the weights become the
        point gradients are taken at); nothing for an optimizer without ``train()``."""
        self._switch_mode("train")

    def eval(self) -> None:
        """Put the optimizer in "eval" mode (schedule-free optimizers: the weights become the
        averaged ones to evaluate and save); nothing for an optimizer without ``eval()``."""
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        # The wrapped optimizer's method, or (an optimizer that wraps another, as DeepSpeed's does) its inner one's.
        target = self.optimizer
        if not callable(getattr(target, mode, None)):
            target = getattr(target, "optimizer", None)
            if not callable(getattr(target, mode, None)):
                return
        if self._in_flight:  # a schedule-free switch rewrites the weights an asynchronous save may still be copying
            self._copies.wait()  # type: ignore[union-attr] - a list that is not empty is the barrier's
        getattr(target, mode)()

    # ---------------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if not self.gradient_state.sync_gradients:
            self._is_overflow = False
            return
        self.sync_steps += 1
        if self._in_flight:  # an asynchronous save_state still copying the weights and this state
            self._copies.wait()  # type: ignore[union-attr] - a list that is not empty is the barrier's
        self._is_overflow = self.precision.optimizer_step(self.optimizer, closure, self._stepped)
        if not self._is_overflow:
            self.real_steps += 1
