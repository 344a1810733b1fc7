"""Dataloaders across processes, at Accelerate's module path ``accelerate.data_loader``.

The package's modules: ``core`` (samplers, the prepared loader and its resumable position),
``dispatch`` (``dispatch_batches=True``: the main process reads for all) and ``prepare`` (what
``Accelerator.prepare`` calls for a DataLoader). The names exported here are Accelerate's, with
Accelerate's signatures: they live in ``hasten.compat.data_loader`` (they read Accelerate's
global state) and load on first use, so the Accelerator, which imports ``core`` and ``prepare``,
never loads them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hasten.compat.data_loader import (
        BatchSamplerShard,
        DataLoaderDispatcher,
        DataLoaderShard,
        DataLoaderStateMixin,
        IterableDatasetShard,
        SeedableRandomSampler,
        SkipBatchSampler,
        SkipDataLoader,
        prepare_data_loader,
        skip_first_batches,
    )

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("hasten.compat.data_loader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
