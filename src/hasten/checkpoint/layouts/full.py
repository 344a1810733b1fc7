"""The "full" layout: full weights and shared state from the main process, one file per process.

::

    model_0.safetensors      full weights of each prepared model, with the model's own keys
                             (model_0.bin with safe_serialization=False)
    optimizer_0.pt           state_dict of each prepared optimizer
    (the rest)               schedulers, scaler, registered objects, loop_state.json and
                             rank_N.pt (RNG states, dataloader positions): see ``base``

Reading checks the world size, object counts, file sizes and checksums, tensor names and
shapes, the optimizers' parameters, state keys and shapes (``restore.match_optimizer``) and the
scaler before anything is restored. The files hold whole tensors, so they load into any strategy:
one process, DDP, FSDP (each process keeps its shards), tensor and pipeline parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint.files import inside
from hasten.checkpoint.layouts.base import HastenLayout
from hasten.checkpoint.plans import FileWrite, ShardedWrite
from hasten.checkpoint.restore import match_optimizer, state_keys
from hasten.checkpoint.weights import compare_tensors, read_weights, tensor_table

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions, Restore


def model_file(i: int, safe: bool) -> str:
    return f"model_{i}.safetensors" if safe else f"model_{i}.bin"


class FullLayout(HastenLayout):
    name = "full"

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
        files = [FileWrite(model_file(i, safe), sd, "weights", safe=safe, large=True) for i, sd in enumerate(weights)]
        files += [FileWrite(f"optimizer_{i}.pt", sd, large=True) for i, sd in enumerate(optimizers)]
        models = [{"file": model_file(i, safe), "tensors": tensor_table(sd)} for i, sd in enumerate(weights)]
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
        shapes: dict[str, list[int]] = {}
        for i, (model, entry) in enumerate(zip(models, manifest["models"])):
            local = tensor_table(ctx.strategy.model_state_dict(model, full=False, check_filled=False))
            current = ctx.strategy.whole_tensor_table(model, local)  # a pipeline stage's: the whole model's
            compare_tensors(entry["tensors"], current, f"{where} (model {i})")
            r.models.append(read_weights(inside(directory, entry["file"], where), options.weights_only))
            compare_tensors(tensor_table(r.models[-1]), current, f"{where} (model {i} file)")
            shapes.update({k: t["shape"] for k, t in current.items()})
        for i, opt in enumerate(ctx.registry.optimizers):
            sd = load(f"optimizer_{i}.pt")
            keys = state_keys(opt)
            r.optimizers.append(match_optimizer(i, sd, r.optimizer_names[i], keys, shapes, where))


LAYOUT = FullLayout()
