"""Checkpoints: ``save_state``/``load_state`` (exact resume), ``save_model``/``load_model`` and ``save``.

The package, by concern:

``context.py``       ``Checkpointable``: the Accelerator's parts a checkpoint saves and restores
                     (process state, the registry of prepared objects, the strategy, precision,
                     loop position, project configuration, pre-hooks), passed explicitly
``state.py``         ``save_state``/``load_state``: the temporary directory, cross-process
                     agreement, manifest and atomic rename, the same for every layout
``manifest.py``      the manifest (``hasten_checkpoint.json``) and its ``layout`` field
``layouts/``         one module per layout; ``full`` is today's (full weights from the main
                     process, one file of RNG states and data positions per process)
``background.py``    asynchronous ``save_state``: staging, the writer thread, its gloo group
``naming.py``        ``project_dir/checkpoints/checkpoint_N``, rotation with ``total_limit``, the
                     locks (one run per checkpoints folder, one save per explicit folder; never
                     through a symbolic link), recovery of an interrupted re-save
``errors.py``        ``CheckpointError``: the cause (OS error and file) torch hides, in one line
``io.py``            atomic file writes, checksums, safetensors with tied-weight aliases
``model_files.py``   Hugging Face-style ``save_model``/``load_model`` and ``save``

Adding a layout: a module in ``layouts/`` with a ``Layout`` object and one line in
``layouts.LAYOUTS``; the strategy that needs it names it in ``checkpoint_layout``.
"""

from __future__ import annotations

from .context import Checkpointable, CheckpointInfo
from .errors import CheckpointError
from .io import parse_size
from .manifest import MANIFEST, read_manifest
from .model_files import load_model, save, save_model
from .state import (
    check_registrable, claim_project_dir, load_state, register_hook, release_checkpoints, save_state, wait_for_checkpoint,
)

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointable",
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
