"""The "full" layout: full weights and shared state from the main process, one file per process.

::

    model.safetensors        full weights of each prepared model (model_1.safetensors ...;
                             pytorch_model.bin ... with safe_serialization=False), with the
                             model's own keys (Accelerate's, but for a model compiled before
                             prepare, whose keys it writes with ``_orig_mod.``)
    optimizer.bin            state_dict of each prepared optimizer (optimizer_1.bin ...)
    (the rest)               schedulers, scaler, registered objects, loop_state.json and
                             random_states_N.pkl (RNG states, dataloader positions): see ``base``

These are the names and forms of Accelerate's ``save_state`` (``names.ACCELERATE``), so
Accelerate's ``load_state`` resumes the folder; checkpoints of earlier versions (``model_0.safetensors``,
``optimizer_0.pt``, ``rank_N.pt``...: ``names.HASTEN``) are read as they are.

Reading checks the world size, object counts, file sizes and checksums, tensor names and
shapes, the optimizers' parameters, state keys and shapes (``restore.match_optimizer``) and the
scaler before anything is restored. The files hold whole tensors, so they load into any strategy:
one process, DDP, FSDP (each process keeps its shards), tensor and pipeline parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint.files import inside
from hasten.checkpoint.layouts.base import HastenLayout, owner_shapes
from hasten.checkpoint.layouts.names import ACCELERATE, names_of
from hasten.checkpoint.plans import FileWrite, ShardedWrite
from hasten.checkpoint.restore import match_optimizer, state_keys
from hasten.checkpoint.weights import compare_tensors, read_weights, tensor_table

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions, Restore


class FullLayout(HastenLayout):
    name = "full"
    file_names = ACCELERATE

    # ------------------------------------------------------------------ save
    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """The models' state dicts the save pre-hooks see and ``plan_save`` plans: full ones here."""
        return [ctx.strategy.model_state_dict(m) for m in models]

    def plan_weights(
        self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool
    ) -> tuple[list[ShardedWrite], list[FileWrite], list[dict[str, Any]]]:
        """The optimizers' full state dicts are taken on every process (gathering them is a
        collective under a sharding strategy); the main process writes them and the models'
        weights (large: from a host copy, in the writer thread, where the save is asynchronous)."""
        optimizers = [ctx.strategy.optimizer_state_dict(o) for o in ctx.registry.optimizers]
        if not ctx.state.is_main_process:
            return [], [], []
        names = self.file_names
        files = [FileWrite(names.model(i, safe), sd, "weights", safe=safe, large=True) for i, sd in enumerate(weights)]
        files += [FileWrite(names.optimizer(i), sd, large=True) for i, sd in enumerate(optimizers)]
        models = [{"file": names.model(i, safe), "tensors": tensor_table(sd)} for i, sd in enumerate(weights)]
        return [], files, models

    # ------------------------------------------------------------------ load
    def read_weights(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any],
        models: list[torch.nn.Module],
        load: Any,
        r: Restore,
        options: LoadOptions,
    ) -> None:
        """Each model's file (its tensor table against the manifest's and the model's), then each
        optimizer's state (its parameter groups against the prepared optimizer's)."""
        where = r.where
        for entry in manifest["models"]:
            if not isinstance(entry, dict) or entry.get("file") not in manifest["files"]:
                named = entry.get("file") if isinstance(entry, dict) else entry
                raise ValueError(
                    f"load_state: the manifest of {where} names a model file {named!r} that its 'files' table "
                    "does not list (so it has no size or checksum to verify)"
                )
        names = names_of(manifest, where)
        shapes: list[dict[str, list[int]]] = []
        for i, (model, entry) in enumerate(zip(models, manifest["models"])):
            local = tensor_table(ctx.strategy.model_state_dict(model, full=False, check_filled=False))
            current = ctx.strategy.whole_tensor_table(model, local)  # a pipeline stage's: the whole model's
            compare_tensors(entry["tensors"], current, f"{where} (model {i})")
            r.models.append(read_weights(inside(directory, entry["file"], where), options.weights_only))
            compare_tensors(tensor_table(r.models[-1]), current, f"{where} (model {i} file)")
            shapes.append({k: t["shape"] for k, t in current.items()})
        for i, opt in enumerate(ctx.registry.optimizers):
            sd = load(names.optimizer(i))
            keys, whole = state_keys(opt), owner_shapes(opt, models, shapes)
            r.optimizers.append(match_optimizer(i, sd, r.optimizer_names[i], keys, whole, where))


LAYOUT = FullLayout()
