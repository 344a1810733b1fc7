"""Checkpoint layouts: how the files of one checkpoint are arranged; each layout plans, never writes.

A layout is a module here with a class implementing :class:`Layout`, listed in ``LAYOUTS``
under the name the manifest's ``layout`` field carries. ``save_state`` plans with the layout
the strategy asks for (``Strategy.checkpoint_layout``): ``plan_save`` returns a
``plans.SavePlan`` (which files, which tensors, what the manifest records), which an executor
writes and the commit step (temporary folder, manifest, rename, rotation) completes, the same
for every layout. ``load_state`` reads with the one the manifest names (or, for a folder without
a manifest, the foreign layout that recognises it): ``read`` returns a ``plans.Restore``,
``restore`` applies it.

Adding a layout: a module here, one line in ``LAYOUTS``, and a strategy whose
``checkpoint_layout`` names it. "full" (full weights from the main process) and "dcp"
(``torch.distributed.checkpoint``, each process writing its shards) are hasten's own (``base``:
what they share); "accelerate" reads Hugging Face Accelerate's folders.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions, Restore, SavePlan

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
        """The models' state dicts that the save pre-hooks see (and may remove) and ``plan_save`` plans."""

    def plan_save(self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool) -> SavePlan:
        """This process's part of a checkpoint (model weights as safetensors with ``safe``):
        its files and sharded folders, and on the main process the manifest fields. Called on
        every process at the same point (taking a sharded state dict may be a collective);
        ``weights`` are the state dicts the save pre-hooks left. Writes nothing."""

    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        options: LoadOptions,
    ) -> Restore:
        """Read and check everything ``restore`` needs; change nothing. ``options.strict_world_size``:
        refuse a checkpoint of another number of processes (else resume from the global positions)."""

    def restore(self, ctx: Checkpointable, r: Restore, directory: str, models: list[torch.nn.Module]) -> None:
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
