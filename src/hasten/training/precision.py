"""Mixed precision: the one object that owns autocast and loss scaling.

``autocast()``, ``backward()``, gradient unscaling/clipping and checkpointing all ask this
object. fp16 works on CPU as well as CUDA (torch has CPU fp16 autocast and
``torch.amp.GradScaler("cpu")``). Consumes ``AutocastKwargs`` and ``GradScalerKwargs``.

Where FSDP shards the models it is built with ``sharded=True`` (fp16's scaler is then
``ShardedGradScaler``, chosen here, once), and it gives FSDP its ``MixedPrecisionPolicy``
(``fsdp_mixed_precision``), which casts a sharded model instead of the autocast forward.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from hasten import _validate as v
from hasten.settings.choices import MIXED_PRECISION_CHOICES
from hasten.settings.dtypes import DTYPES
from hasten.settings.handlers import AutocastKwargs, GradScalerKwargs


def _to_fp32(obj: Any) -> Any:
    """Low-precision floating tensors in a model's output, cast back to float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):
        return type(obj)({k: _to_fp32(x) for k, x in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_fp32(x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_fp32(x) for x in obj)
    return obj


class Precision:
    """Autocast context and GradScaler for one Accelerator."""

    def __init__(
        self,
        mixed_precision: str,
        device: torch.device,
        autocast_handler: AutocastKwargs | None = None,
        scaler_handler: GradScalerKwargs | None = None,
        *,
        sharded: bool = False,
        loss_scaling: bool = False,
    ) -> None:
        self.mode = v.check_choice("Accelerator", "mixed_precision", mixed_precision, MIXED_PRECISION_CHOICES)
        self.device_type = device.type
        self.dtype: torch.dtype | None = DTYPES.get(self.mode)
        self.autocast_handler = autocast_handler or AutocastKwargs()
        #: FSDP shards the models over several processes: fp16's scaler is a ShardedGradScaler
        self.sharded = v.check_bool("Precision", "sharded", sharded)
        self.scaler: torch.amp.GradScaler | None = None
        #: what the scaler is built from
        self.scaler_handler = scaler_handler or GradScalerKwargs()
        #: a GradScaler in fp16, and in fp8 where the backend needs one (MS-AMP)
        if self.mode == "fp16" or v.check_bool("Precision", "loss_scaling", loss_scaling):
            scaler_handler = self.scaler_handler
            if scaler_handler.enabled:
                self.scaler = scaler_handler.build(self.device_type, sharded=self.sharded)
        if self.mode == "fp16" and self.device_type == "cpu":
            import warnings

            warnings.warn(
                "mixed_precision='fp16' on the CPU is much slower than 'bf16' (torch's float16 CPU kernels, such as "
                "convolution backward, are slow): use 'bf16' on the CPU unless you are "
                "trying fp16's loss scaling before a GPU run",
                UserWarning,
                stacklevel=4,  # Accelerator(...), through _start
            )
        # Optimizers whose gradients were unscaled since their last step (unscale once per step).
        self._unscaled: set[int] = set()
        #: The hook point around backward: a context-manager factory entered around each
        #: ``backward`` while set (the profiler's label uses it); None costs one comparison.
        self.around_backward: Callable[[], contextlib.AbstractContextManager] | None = None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    # ------------------------------------------------------------------ autocast
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """The autocast context for this precision; a handler here overrides the default one."""
        if autocast_handler is not None and not isinstance(autocast_handler, AutocastKwargs):
            raise TypeError(f"autocast_handler must be an AutocastKwargs, got {autocast_handler!r}")
        if self.dtype is None:
            return contextlib.nullcontext()
        handler = autocast_handler or self.autocast_handler
        return torch.autocast(**handler.autocast_kwargs(self.device_type, self.dtype))

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Make ``model.forward`` run under autocast and return float32 outputs.

        With mixed precision off nothing is changed: the forward is the model's own.
        """
        if self.dtype is None or not self.autocast_handler.enabled:
            return
        if hasattr(model.forward, "_hasten_original_forward"):
            return  # prepared before: one autocast is enough
        original = model.forward
        autocast_kwargs = self.autocast_handler.autocast_kwargs(self.device_type, self.dtype)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(**autocast_kwargs):
                out = original(*args, **kwargs)
            return _to_fp32(out)

        forward._hasten_original_forward = original  # type: ignore[attr-defined]
        model.forward = forward  # type: ignore[method-assign]

    def fsdp_mixed_precision(self, given: Any = None, *, root: bool = False) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``, what a sharded model casts with instead of the
        autocast forward: ``given`` (the plugin's, a ``MixedPrecisionPolicy``) as it is, else
        parameters gathered in this precision's dtype and gradients reduced in fp32, and with
        ``root`` the root module's outputs in fp32 (as prepared models return them under autocast)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if given is not None:
            return given
        if self.dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.dtype, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
        )

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> None:
        original = getattr(model.forward, "_hasten_original_forward", None)
        if original is not None:
            # Remove the instance attribute so the class's forward is used again.
            if getattr(original, "__self__", None) is model and "forward" in model.__dict__:
                del model.__dict__["forward"]
            else:
                model.forward = original  # type: ignore[method-assign]

    # ------------------------------------------------------------------ loss scaling
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.around_backward is not None:
            with self.around_backward():
                self._backward(loss, **kwargs)
        else:
            self._backward(loss, **kwargs)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's gradients once per step (a no-op without a scaler)."""
        if self.scaler is None or id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def track_steps(self, optimizer: torch.optim.Optimizer) -> Callable[[], bool] | None:
        """With a scaler: make ``optimizer`` record whether its ``step`` ran; returns the reader.

        ``GradScaler.step`` calls ``optimizer.step()`` only when the gradients are finite,
        after the one device sync it makes anyway, so "was this step skipped" is known
        without reading the scale back (``get_scale()`` is a sync of its own on a GPU).
        Done once at ``prepare``: the optimizer's ``step`` gets a wrapper that sets a flag.
        Optimizers that handle the scale themselves (``_step_supports_amp_scaling``, e.g.
        fused Adam) always have ``step`` called, so for them None is returned and the scale
        is compared instead.
        """
        if self.scaler is None or getattr(optimizer, "_step_supports_amp_scaling", False):
            return None
        ran = [False]
        inner = optimizer.step

        @functools.wraps(inner)
        def step(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            ran[0] = True
            return inner(*args, **kwargs)

        # A bound method, as torch's LR schedulers expect to find (they wrap ``step.__func__``).
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

        def stepped() -> bool:
            value, ran[0] = ran[0], False
            return value

        return stepped

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Any = None, stepped: Callable[[], bool] | None = None
    ) -> bool:
        """Step the optimizer; return True if the step was skipped (inf/nan gradients).

        ``stepped`` is the reader ``track_steps`` returned for this optimizer: with it no
        device sync is added to the one ``GradScaler.step`` makes.
        """
        if self.scaler is None:
            optimizer.step(closure) if closure is not None else optimizer.step()
            return False
        scale_before = self.scaler.get_scale() if stepped is None else None
        if stepped is not None:
            stepped()  # clear a flag left by a step() called outside the scaler
        self.scaler.step(optimizer, closure) if closure is not None else self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        if stepped is not None:
            return not stepped()
        return self.scaler.get_scale() < scale_before  # type: ignore[operator]

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
