"""Accelerate's ``PartialState``, ``AcceleratorState`` and ``GradientState`` singletons.

hasten's runtime has plain classes (``hasten.distributed.state``): ``ProcessState`` (the process facts),
``RunState`` (an Accelerator's: the facts plus the mixed precision) and ``LoopState`` (the loop's
position). These subclasses add what Accelerate's scripts expect of the global state:

- ``AcceleratorState()`` and ``GradientState()`` return the states of the most recently made
  Accelerator (``accelerator.state``, ``accelerator.gradient_state``), while there is one;
- the Accelerator's own states are instances of these names (``isinstance`` counts every
  instance of the runtime class);
- ``PartialState._shared_state`` is the facts of the most recently made state;
- ``_reset_state()`` empties every existing state: reading a fact of one then reads the state
  made after it, or says why it cannot (the runtime's own, so ``accelerator.state._reset_state()``
  works without this module).

All of it reads the record that ``hasten.distributed.state`` keeps of the states made, so the runtime
never imports this module (``hasten``'s top level loads it on first use of one of these names).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hasten.distributed import state as runtime
from hasten.distributed.state import DistributedType, LoopState, ProcessState, RunState
from hasten.settings.handlers import InitProcessGroupKwargs

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]


class _CountsRuntime(type):
    """The metaclass of Accelerate's names: ``isinstance(x, Name)`` holds for every instance of
    ``Name._runtime`` (hasten's class under it), so an Accelerator's own states are instances of
    Accelerate's names, as in Accelerate."""

    _runtime: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._runtime)


class PartialState(ProcessState, metaclass=_CountsRuntime):
    """Where this process stands: rank, world size, device, process group (see ``ProcessState``).

    ``PartialState._shared_state`` is, as in Accelerate, a dict of the facts of the most recently
    created state (empty before any and after ``_reset_state()``).
    """

    _runtime = ProcessState
    _shared_state: dict[str, Any] = runtime._facts

    def __init__(
        self,
        cpu: bool = False,
        init_handler: InitProcessGroupKwargs | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"PartialState got unexpected keyword arguments {sorted(kwargs)}; allowed: cpu, init_handler, "
                "backend, timeout"
            )
        if init_handler is not None and not isinstance(init_handler, InitProcessGroupKwargs):
            raise TypeError(f"PartialState.init_handler must be an InitProcessGroupKwargs, got {init_handler!r}")
        if init_handler is not None and (backend is not None or timeout is not None):
            raise TypeError("PartialState: give backend=/timeout= or init_handler=, not both")
        if backend is not None or timeout is not None:
            # Accelerate's spelling (transformers' TrainingArguments passes them): the process
            # group's arguments, checked as InitProcessGroupKwargs checks them
            init_handler = InitProcessGroupKwargs(backend=backend, timeout=timeout)
        super().__init__(cpu=cpu, init_handler=init_handler)


class AcceleratorState(RunState, PartialState):
    """Accelerate's ``AcceleratorState``: the process facts of ``PartialState`` plus the mixed precision.

    Each Accelerator has its own (``accelerator.state``, a ``RunState``). hasten keeps no
    process-wide Accelerator singleton (several Accelerators may live in one process), so
    ``AcceleratorState()`` returns the state of the **most recently created** Accelerator. Before
    any Accelerator exists it describes this process from the environment (``mixed_precision``
    from the argument, else ``HASTEN_MIXED_PRECISION``/``ACCELERATE_MIXED_PRECISION``, else "no").
    ``AcceleratorState._reset_state()`` empties every existing AcceleratorState, as Accelerate's
    does: an Accelerator made before it then fails with an error saying so (make a new one).
    """

    _runtime = RunState

    def __new__(cls, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any) -> Any:
        refused = sorted(k for k, val in kwargs.items() if val not in (None, False))
        if refused:
            raise TypeError(
                f"AcceleratorState got unsupported arguments {refused}; allowed: mixed_precision, cpu "
                "(DeepSpeed, Megatron-LM and XLA plugins are not supported by hasten)"
            )
        current = runtime._current.get("state")
        if current is None:
            return super().__new__(cls)
        if mixed_precision is not None and str(mixed_precision) != current.mixed_precision:
            raise ValueError(
                f"AcceleratorState(mixed_precision={mixed_precision!r}) disagrees with the current "
                f"Accelerator's mixed_precision={current.mixed_precision!r}"
            )
        return current  # the current Accelerator's own (a RunState: __init__ does not run on it)

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any) -> None:
        from hasten._validate import check_choice
        from hasten.settings import environment as env
        from hasten.settings.choices import MIXED_PRECISION_CHOICES

        if mixed_precision is None:
            mixed_precision = (env.env_text(env.HASTEN_MIXED_PRECISION, env.ACCELERATE_MIXED_PRECISION) or "no").lower()
        mode = check_choice("AcceleratorState", "mixed_precision", str(mixed_precision), MIXED_PRECISION_CHOICES)
        super().__init__(cpu=cpu)
        self.mixed_precision = mode


class GradientState(LoopState, metaclass=_CountsRuntime):
    """Accelerate's ``GradientState``: the training loop's position (see ``LoopState``).

    ``GradientState()`` with no arguments, as Accelerate's scripts write it, is the
    ``gradient_state`` of the most recently created Accelerator, while that one lives; with
    arguments (or without an Accelerator) it is a new one.
    """

    __slots__ = ()
    _runtime = LoopState

    def __new__(cls, num_steps: int | None = None, **kwargs: Any) -> Any:
        if num_steps is None and not any(kwargs.values()):
            ref = runtime._current.get("gradient")
            current = ref() if ref is not None else None
            if current is not None:
                return current  # a LoopState: __init__ does not run on it
        return super().__new__(cls)

    @staticmethod
    def _reset_state() -> None:
        """Forget the Accelerator that ``GradientState()`` returns the state of (for tests)."""
        runtime._current.pop("gradient", None)
