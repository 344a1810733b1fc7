"""The strategy interface and what every strategy shares."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..precision import Precision
    from ..state import PartialState


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``).

    Without ``torch._dynamo`` imported no module can be compiled, so this imports nothing.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile``'s wrappers, else ``module``."""
    while is_compiled(module):
        module = module._orig_mod
    return module


def strip_wrappers(
    module: torch.nn.Module,
    inner: Callable[[torch.nn.Module], torch.nn.Module | None],
    keep_torch_compile: bool = False,
) -> torch.nn.Module:
    """``module`` without ``torch.compile``'s wrappers and those ``inner`` opens, in any nesting.

    With ``keep_torch_compile`` the compiled wrapper nearest to the innermost module is
    returned where there is one.
    """
    compiled = None
    while True:
        if is_compiled(module):
            compiled = module
            module = module._orig_mod
            continue
        opened = inner(module)
        if opened is None:
            break
        module = opened
    return compiled if keep_torch_compile and compiled is not None else module


class Strategy:
    """How one Accelerator places, wraps, synchronises and checkpoints its models.

    Subclasses override ``_wrap`` (and whatever else differs); the defaults are those of a
    module that is not wrapped at all.
    """

    name = "single"
    #: the checkpoint layout (a name in hasten.checkpoint.layouts) that save_state writes
    checkpoint_layout = "full"
    #: what ``Accelerator.distributed_type`` reports; None: the process state's (NO, MULTI_CPU, MULTI_GPU)
    distributed_type: Any = None

    def __init__(self, state: PartialState, precision: Precision) -> None:
        self.state = state
        self.precision = precision

    # ------------------------------------------------------------------ modules
    def setup_module(
        self, module: torch.nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place ``module``, give it the autocast forward, then wrap it (not with ``evaluation_mode``).

        The autocast forward goes on the user's module, inside any wrapper, so the module that
        ``unwrap`` returns autocasts the same way on any number of processes (Accelerate's
        ``keep_fp32_wrapper=True``).
        """
        if device_placement:
            module = module.to(self.state.device)
        self.precision.wrap_forward(self.unwrap(module))
        return module if evaluation_mode else self._wrap(module)

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, rebound to the wrapped parameters where a wrapper replaced them.

        Replicating strategies keep the module's own parameters, so this returns ``optimizer``.
        """
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Inside the block, backward accumulates gradients locally without synchronising them."""
        return contextlib.nullcontext()

    def _inner(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The module inside this strategy's wrapper, or None if ``module`` is not one."""
        return None

    def unwrap(self, module: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's own module, without this strategy's wrapper and ``torch.compile``'s.

        With ``keep_torch_compile`` the compiled wrapper nearest to the user's module is
        returned where there is one (Accelerate's ``unwrap_model(..., keep_torch_compile=True)``).
        """
        return strip_wrappers(module, self._inner, keep_torch_compile)

    # ------------------------------------------------------------------ state dicts
    def model_state_dict(self, module: torch.nn.Module, full: bool = True) -> dict[str, Any]:
        """The full state dict, with the model's own keys (no wrapper prefixes).

        With ``full=False`` a sharding strategy returns this process's shards (DTensors with the
        global shapes) instead of gathering them; the others return the full one either way.
        """
        return self.unwrap(module).state_dict()

    def load_model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        return self.unwrap(module).load_state_dict(state_dict, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        optimizer.load_state_dict(state_dict)

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``parameters``; returns their total norm."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.state.device}, num_processes={self.state.num_processes})"
