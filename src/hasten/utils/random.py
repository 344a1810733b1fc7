"""``accelerate.utils.random``: seeding and sharing the main process's random states (homed in
``hasten.training.rng``)."""

from __future__ import annotations

import torch

from hasten import _validate as v
from hasten.training.rng import set_seed, synchronize_rng_states
from hasten.utils.dataclasses import RNGType

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]

_SYNCHRONIZED = ("torch", "cuda", "generator")


def synchronize_rng_state(rng_type: RNGType | str | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process the main process's state of one generator (Accelerate's): ``rng_type``
    ``"torch"`` (the CPU generator), ``"cuda"`` (the current CUDA device's) or ``"generator"``
    (``generator``, required then), as an ``RNGType`` or its value. A no-op on one process.

    The other devices' generators (XLA, NPU, MLU, ...) are refused naming the device: hasten
    trains on CPUs and CUDA GPUs.
    """
    name = getattr(rng_type, "value", rng_type)
    if name is None:
        raise ValueError(
            f"synchronize_rng_state.rng_type is required: one of {', '.join(map(repr, _SYNCHRONIZED))} "
            "(or an RNGType member)"
        )
    if isinstance(name, str) and name in RNGType and name not in _SYNCHRONIZED:
        raise ValueError(
            f"synchronize_rng_state.rng_type={name!r}: the {name.upper()} device's generator is not one hasten "
            f"runs (it trains on CPUs and CUDA GPUs); use one of {', '.join(map(repr, _SYNCHRONIZED))}"
        )
    name = v.check_choice("synchronize_rng_state", "rng_type", name, _SYNCHRONIZED)
    synchronize_rng_states([name], generator=generator)
