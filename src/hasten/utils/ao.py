"""``accelerate.utils.ao``: torchao fp8 training on hasten's fp8 machinery (``hasten.training.float8``).

``convert_model_to_fp8_ao`` converts through ``float8.apply_float8`` (the conversion ``prepare``
runs for ``mixed_precision="fp8"``), with Accelerate's default filter (every ``nn.Linear`` whose
dimensions are multiples of 16, except the model's first and last). Where the machine has no
fp8 matmul (a CPU, a GPU older than compute capability 8.9) the converted layers emulate it
(torchao's ``emulate``: casts to fp8 and back, as hasten's ``prepare`` does), whatever torch's
fp8 kernels support there; on a CPU the outputs equal those of Accelerate's conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hasten.utils.imports import torchao_required

__all__ = ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"]


def _first_and_last_linear(model: torch.nn.Module) -> tuple[str | None, str | None]:
    from hasten.training.float8 import first_and_last_linear

    return first_and_last_linear(model)


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """Accelerate's filter, as it is: False for an ``nn.Linear`` whose dimensions are not
    multiples of 16, and for a ``fqn`` that is the first or last ``nn.Linear`` of ``module``
    itself (called by torchao on each layer, that is the layer's own name ``""``: so every layer
    of fitting size passes, the model's first and last included; leave ``module_filter_func``
    unset for Accelerate's default, which keeps them in high precision)."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in _first_and_last_linear(module)


@torchao_required
def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a torchao ``Float8Linear`` layer."""
    from hasten.training.float8 import require_torchao

    float8_linear = require_torchao("has_ao_layers").float8_linear.Float8Linear
    return any(isinstance(m, float8_linear) for m in model.modules())


@torchao_required
def convert_model_to_fp8_ao(
    model: torch.nn.Module, config: Any = None, module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None
) -> None:
    """Convert ``model``'s ``nn.Linear`` layers to torchao's ``Float8Linear`` in place, as
    Accelerate's: ``config`` is torchao's ``Float8LinearConfig`` (None: torchao's default one),
    ``module_filter_func(module, fqn)`` chooses the layers (None: every layer whose dimensions are
    multiples of 16, except the model's first and last). Where this machine has no fp8 matmul the
    layers emulate it (the conversion is the same)."""
    from hasten.training import float8

    module = float8.require_torchao("convert_model_to_fp8_ao")
    if config is None:
        config = module.Float8LinearConfig()
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if not config.emulate and not float8.runs_natively(device if device.type == "cuda" else None)[0]:
        config = dataclasses.replace(config, emulate=True)
    float8.apply_float8(model, float8.Float8Plan(config, module_filter_func, cpu_autocast_input=on_cpu))
