"""Checkpoint layouts: how the files of one checkpoint are arranged, written and read back.

A layout is a module here with a class implementing :class:`Layout`, listed in ``LAYOUTS``
under the name the manifest's ``layout`` field carries. ``save_state`` writes the layout the
strategy asks for (``Strategy.checkpoint_layout``); ``load_state`` reads the one the manifest
names (or, for a folder without a manifest, the foreign layout that recognises it). The
atomic temporary directory, the cross-process agreement, naming and rotation stay in
``hasten.checkpoint.state`` and are the same for every layout.

Adding a layout: a module here, one line in ``LAYOUTS``, and a strategy whose
``checkpoint_layout`` names it. "full" (full weights from the main process) and "dcp"
(``torch.distributed.checkpoint``, each process writing its shards) are hasten's own.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..context import Checkpointable

#: layout name (the manifest's ``layout`` field) -> module defining ``LAYOUT``
LAYOUTS = {
    "full": "hasten.checkpoint.layouts.full",
    "accelerate": "hasten.checkpoint.layouts.accelerate",  # read only: Accelerate's save_state folders
    "dcp": "hasten.checkpoint.layouts.dcp",
}


class Layout(Protocol):
    name: str
    #: False for layouts hasten reads but never writes (another library's checkpoints)
    writable: bool

    def recognises(self, directory: str) -> bool:
        """Whether ``directory``, which has no hasten manifest, is a checkpoint of this layout."""

    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """The models' state dicts that the save pre-hooks see (and may remove) and ``write`` saves."""

    def write(
        self, ctx: Checkpointable, tmp: str, weights: list[dict[str, Any]], *, safe: bool = True, stage: Any = None
    ) -> tuple[dict[str, str], dict[str, Any], list[Any]]:
        """Write this process's files into ``tmp`` (model weights as safetensors with ``safe``);
        returns {file name: path}, on the main process the fields this layout adds to the
        manifest, and the writes left for the background thread: with ``stage`` (an asynchronous
        save, ``stage(state_dict)`` returns a ``Future`` of its copy in host memory, made in the
        background thread before the jobs run) the large files are ``job(group) -> {file name:
        path}`` callables holding those futures, run later with the gloo group of
        ``background.group()``; without it, none. ``weights`` are the state dicts the save
        pre-hooks left. Files written through ``io.write``/``io.dcp_writer`` are hashed as written."""

    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        weights_only: bool,
        verify_checksums: bool,
        strict_world_size: bool = False,
    ) -> Any:
        """Read and check everything ``restore`` needs; change nothing. ``strict_world_size``:
        refuse a checkpoint of another number of processes (else resume from the global positions)."""

    def restore(self, ctx: Checkpointable, data: Any, directory: str, models: list[torch.nn.Module]) -> None:
        """Apply what ``read`` returned."""


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"checkpoint layout {name!r} is not known to this hasten; known: {', '.join(sorted(LAYOUTS))}")
    return importlib.import_module(LAYOUTS[name]).LAYOUT


def foreign_layout(directory: str) -> Layout | None:
    """The layout that recognises ``directory`` (which has no hasten manifest), if any."""
    if not os.path.isdir(directory):
        return None
    for name in LAYOUTS:
        layout = get_layout(name)
        if not layout.writable and layout.recognises(directory):
            return layout
    return None
