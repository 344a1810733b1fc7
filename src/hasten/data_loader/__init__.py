"""Dataloaders across processes, at Accelerate's module path ``accelerate.data_loader``.

The names exported here are Accelerate's, with Accelerate's signatures (``compat.py``). The
package's modules: ``core`` (samplers, the prepared loader and its resumable position),
``dispatch`` (``dispatch_batches=True``: the main process reads for all), ``prepare`` (what
``Accelerator.prepare`` calls for a DataLoader) and ``compat`` (Accelerate's constructors and
free functions over them).
"""

from __future__ import annotations

from .compat import (
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
