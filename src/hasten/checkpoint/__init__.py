"""Checkpoints: ``save_state``/``load_state`` (exact resume), ``save_model``/``load_model`` and ``save``.

The package, by concern:

``checkpointer.py``  ``Checkpointer``, held by the Accelerator: ``save_state``/``load_state``,
                     the order of their steps, the choice of executor for each save
``context.py``       ``Checkpointable``: the Accelerator's parts a checkpoint saves and restores
                     (process state, the registry of prepared objects, the strategy, precision,
                     loop position, project configuration, pre-hooks), passed explicitly
``plans.py``         what a layout plans: ``SavePlan`` (files, sharded folders, manifest fields)
                     and ``Restore`` (what a load applies)
``layouts/``         one planner module per layout (the manifest's ``layout`` field): ``full``
                     (full weights from the main process), ``dcp`` (sharded), ``accelerate``
                     (Accelerate's folders, read only); ``base``: what hasten's two share
``executor.py``      ``Executor``: writes a plan now (a synchronous save)
``background.py``    ``BackgroundExecutor``: an asynchronous save (host copies, the writer thread,
                     its gloo group)
``barrier.py``       ``CopyBarrier``: what the next optimizer step waits for during an async save
``commit.py``        the commit step: temporary folder, manifest, fsync, rename, rotation, and
                     recovery of what interrupted saves left
``restore.py``       putting a read checkpoint back, and the readers the layouts share
``manifest.py``      the manifest (``hasten_checkpoint.json``) and its ``layout`` field
``naming.py``        ``project_dir/checkpoints/checkpoint_N``, rotation with ``total_limit``,
                     recovery of an interrupted re-save, the marks of a save at a URL
``locks.py``         the local disk's locks (one run per checkpoints folder, one save per explicit
                     folder; never through a symbolic link)
``files.py``         atomic, fsynced writes hashed as written; paths
``storage.py``       where files live: the local disk or any fsspec URL (``s3://``, ``gs://`` ...),
                     chosen once per path; the questions readers ask of either
``checksums.py``     XXH3-128 records of files and of their parts; verification
``dcp_io.py``        torch.distributed.checkpoint's writer and reader, hashing and verifying
``weights.py``       model weights files (safetensors with tied-weight aliases, torch files)
``unpickle.py``      reading pickles through allow-lists only
``errors.py``        ``CheckpointError``: the cause (OS error and file) torch hides, in one line
``model_files.py``   Hugging Face-style ``save_model``/``load_model`` and ``save``
``merge.py``         ``hasten merge-weights``: one model's full weights from a checkpoint

Adding a layout: a module in ``layouts/`` with a ``Layout`` object and one line in
``layouts.LAYOUTS``; the strategy that needs it names it in ``checkpoint_layout``.
"""

from __future__ import annotations

from hasten.checkpoint.barrier import CopyBarrier
from hasten.checkpoint.checkpointer import (
    Checkpointer,
    check_registrable,
    claim_project_dir,
    load_state,
    register_hook,
    release_checkpoints,
    save_state,
    wait_for_checkpoint,
)
from hasten.checkpoint.context import Checkpointable, CheckpointInfo
from hasten.checkpoint.errors import CheckpointError
from hasten.checkpoint.files import parse_size
from hasten.checkpoint.manifest import MANIFEST, read_manifest
from hasten.checkpoint.model_files import load_model, save, save_model

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointable",
    "Checkpointer",
    "CopyBarrier",
    "check_registrable",
    "claim_project_dir",
    "load_model",
    "load_state",
    "parse_size",
    "read_manifest",
    "register_hook",
    "release_checkpoints",
    "save",
    "save_model",
    "save_state",
    "wait_for_checkpoint",
]
