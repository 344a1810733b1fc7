"""The manifest (``hasten_checkpoint.json``): written last, it makes a directory a checkpoint.

It names the layout the files follow (``layout``; "full" where absent, as in checkpoints of
earlier versions), the versions, world size, mixed precision, object counts, the models'
tensor tables and each file's size and SHA-256.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

MANIFEST = "hasten_checkpoint.json"
FORMAT = "hasten-checkpoint"
FORMAT_VERSION = 1
DEFAULT_LAYOUT = "full"


def build_manifest(layout: str, **fields: Any) -> dict[str, Any]:
    from .. import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "hasten_version": __version__,
        "torch_version": torch.__version__,
        **fields,
    }


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a clear error for anything else."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"load_state: no checkpoint directory at {directory!r}")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(
            f"load_state: {directory!r} has no {MANIFEST}, so it is not a complete hasten checkpoint "
            "(a save that did not finish, or a directory written by something else)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"load_state: the manifest {path!r} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"load_state: {path!r} is not a hasten checkpoint manifest")
    if not isinstance(manifest.get("format_version"), int) or manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"load_state: {path!r} has format_version {manifest.get('format_version')!r}; "
            f"this hasten reads versions up to {FORMAT_VERSION}"
        )
    manifest.setdefault("layout", DEFAULT_LAYOUT)
    return manifest
