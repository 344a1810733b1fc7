"""One process: the module is placed and given the autocast forward, never wrapped."""

from __future__ import annotations

from hasten.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """One process on one device (CPU or one GPU)."""

    name = "single"
