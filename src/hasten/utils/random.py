"""``accelerate.utils.random``: the names hasten has (homed in ``hasten.training.rng``)."""

from __future__ import annotations

from hasten.training.rng import set_seed, synchronize_rng_states

__all__ = ["set_seed", "synchronize_rng_states"]
