"""``accelerate.utils.transformer_engine``: NVIDIA TransformerEngine's fp8 layers and autocast.

Each needs the ``transformer_engine`` package (an ImportError naming it otherwise, as in
Accelerate) and, to run fp8, a GPU of compute capability 8.9 or newer. ``convert_model`` swaps
layers as ``prepare`` does for ``mixed_precision="fp8"`` with ``TERecipeKwargs``
(``hasten.training.float8``); Intel's HPU TransformerEngine is not used (hasten runs on CPU and CUDA).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model", "has_transformer_engine_layers"]


def _te(what: str) -> Any:
    """``transformer_engine.pytorch``, or Accelerate's ImportError for ``what``."""
    from hasten.utils.imports import is_transformer_engine_available

    if not is_transformer_engine_available():
        raise ImportError(
            f"Using `{what}` requires transformer_engine to be installed (pip install transformer_engine[pytorch], "
            "on a machine with CUDA); hasten's fp8 without it is torchao's: AORecipeKwargs, pip install 'hasten[fp8]'"
        )
    import transformer_engine.pytorch as te

    return te


def convert_model(
    model: torch.nn.Module, to_transformer_engine: bool = True, _convert_linear: bool = True, _convert_ln: bool = True
) -> None:
    """Swap ``model``'s ``nn.Linear`` (dimensions multiples of 16) and ``nn.LayerNorm`` layers for
    TransformerEngine's, their values copied, in place; with ``to_transformer_engine=False``,
    TransformerEngine's back to torch's. (Accelerate stops at the first Linear whose dimensions
    do not fit, leaving its later siblings unconverted; here only that layer stays as it is.)"""
    te = _te("convert_model")
    from hasten.training.float8 import _swap_te

    for name, child in list(model.named_modules()):
        if not name:
            continue
        if to_transformer_engine:
            if (_convert_linear and type(child) is torch.nn.Linear) or (
                _convert_ln and type(child) is torch.nn.LayerNorm
            ):
                _swap_te(model, name, child, te)
        elif (_convert_linear and isinstance(child, te.Linear)) or (_convert_ln and isinstance(child, te.LayerNorm)):
            _swap_back(model, name, child, te)


def _swap_back(root: torch.nn.Module, name: str, child: Any, te: Any) -> None:
    """A TransformerEngine layer back to torch's, its values copied."""
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    kwargs = {"dtype": child.weight.dtype, "device": child.weight.device}
    if isinstance(child, te.Linear):
        bias = child.bias is not None
        new: torch.nn.Module = torch.nn.Linear(child.in_features, child.out_features, bias=bias, **kwargs)
    else:
        new = torch.nn.LayerNorm(child.weight.shape[0], eps=child.eps, **kwargs)
    with torch.no_grad():
        new.weight.copy_(child.weight)
        if getattr(child, "bias", None) is not None:
            new.bias.copy_(child.bias)
    setattr(parent, attr, new)


def has_transformer_engine_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a TransformerEngine ``LayerNorm``, ``Linear`` or ``TransformerLayer``."""
    te = _te("has_transformer_engine_layers")
    kinds = tuple(getattr(te, n) for n in ("LayerNorm", "Linear", "TransformerLayer") if hasattr(te, n))
    return any(isinstance(m, kinds) for m in model.modules())


def contextual_fp8_autocast(model_forward: Callable, fp8_recipe: Any, use_during_eval: bool = False) -> Callable:
    """A forward ``forward(self, *args, **kwargs)`` that runs ``model_forward`` under
    TransformerEngine's ``fp8_autocast`` with ``fp8_recipe`` while ``self.training`` (always with
    ``use_during_eval``); the original is kept as its ``__wrapped__``."""
    fp8_autocast = _te("contextual_fp8_autocast").fp8_autocast

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fp8_autocast(enabled=use_during_eval or self.training, fp8_recipe=fp8_recipe):
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward  # type: ignore[attr-defined]
    return forward


def _recipe(handler: Any) -> tuple[Any, bool]:
    """TransformerEngine's recipe for ``handler`` (a ``TERecipeKwargs`` or None) and its
    ``use_autocast_during_eval``, as Accelerate builds them (its non-default fields)."""
    import transformer_engine.common.recipe as te_recipe

    kwargs = handler.to_kwargs() if handler is not None else {}
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    during_eval = bool(kwargs.pop("use_autocast_during_eval", False))
    if not kwargs.pop("use_mxfp8_block_scaling", False):
        return te_recipe.DelayedScaling(**kwargs), during_eval
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    available, message = check_mxfp8_support()
    if not available:
        raise ValueError(f"MXFP8 block scaling is not available: {message}")
    for field in ("amax_compute_algo", "amax_history_len"):
        if field in kwargs:
            raise ValueError(f"`{field}` is not supported for MXFP8 block scaling.")
    return te_recipe.MXFP8BlockScaling(**kwargs), during_eval


def apply_fp8_autowrap(model: torch.nn.Module, fp8_recipe_handler: Any) -> torch.nn.Module:
    """``model``'s forward run under ``fp8_autocast`` with the recipe of ``fp8_recipe_handler``
    (a ``TERecipeKwargs``, or None for TransformerEngine's default ``DelayedScaling``); returns
    ``model``."""
    _te("apply_fp8_autowrap")
    recipe, during_eval = _recipe(fp8_recipe_handler)
    forward = contextual_fp8_autocast(model.forward, recipe, during_eval)
    if hasattr(model.forward, "__func__"):
        model.forward = types.MethodType(forward, model)
    else:
        model.forward = forward
    return model
