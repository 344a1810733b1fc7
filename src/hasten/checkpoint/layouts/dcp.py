"""The "dcp" layout: models and optimizers sharded with ``torch.distributed.checkpoint``.

::

    model_0/                 torch.distributed.checkpoint folder of each prepared model: every
      .metadata              process writes its own shards (``__R_0.distcp``), in parallel; keys
      __0_0.distcp ...       are the model's own (no wrapper prefixes)
    optimizer_0/             the same for each optimizer, keyed by parameter names
    (the rest)               as in the "full" layout: schedulers, scaler, registered objects,
                             loop_state.json and rank_N.pt (RNG states, dataloader positions)

Written by the FSDP strategy (``state_dict_type="SHARDED_STATE_DICT"``, also on one process).
``torch.distributed.checkpoint`` reshards on load, so the models and optimizers load at any
number of processes (and into a plain model with ``hasten merge-weights``); the per-process
files are read as in the "full" layout (rank 0's global dataloader positions at another number).
Everything but the models and optimizers is the "full" layout's code.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import io
from .full import FullLayout

if TYPE_CHECKING:  # pragma: no cover
    from ..context import Checkpointable


def _folder_files(tmp: str, folder: str) -> dict[str, str]:
    base = os.path.join(tmp, folder)
    return {f"{folder}/{name}": os.path.join(base, name) for name in sorted(os.listdir(base))}


def _no_dist() -> bool:
    """One process without a process group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _dcp() -> Iterator[Any]:
    """``torch.distributed.checkpoint``, without its warning that one process without a group is one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield dcp


def _empty_like(obj: Any) -> Any:
    """A structure like ``obj`` whose tensors are new (DTensors keep their sharding), for loading into."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_like(x) for k, x in obj.items()}
    if isinstance(obj, list):
        return [_empty_like(x) for x in obj]
    return obj


class DCPLayout(FullLayout):
    name = "dcp"
    writable = True
    resize_hint = (
        " (strict_world_size=False, the default, reshards the models and optimizers of this sharded "
        "checkpoint and resumes from the global dataloader positions)"
    )

    # ------------------------------------------------------------------ save
    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """This process's shards (DTensors with the global shapes); no gathering."""
        return [ctx.strategy.model_state_dict(m, full=False) for m in models]

    def write_collective(
        self, ctx: Checkpointable, tmp: str, weights: list[dict[str, Any]], info: dict[str, Any]
    ) -> dict[str, str]:
        main = ctx.state.is_main_process
        written: dict[str, str] = {}
        info["models"], info["optimizers"] = [], None
        for i, sd in enumerate(weights):
            folder = f"model_{i}"
            with _dcp() as dcp:
                dcp.save(sd, storage_writer=io.dcp_writer(os.path.join(tmp, folder)), no_dist=_no_dist())
            info["models"].append({"dir": folder, "tensors": io.tensor_table(sd)})
            if main:
                written.update(_folder_files(tmp, folder))
        for i, opt in enumerate(ctx.registry.optimizers):
            folder = f"optimizer_{i}"
            osd = ctx.strategy.optimizer_state_dict(opt, full=False)
            with _dcp() as dcp:
                dcp.save(osd, storage_writer=io.dcp_writer(os.path.join(tmp, folder)), no_dist=_no_dist())
            if main:
                written.update(_folder_files(tmp, folder))
        return written

    def write_models(self, ctx: Checkpointable, tmp: str, safe: bool, info: dict[str, Any], weights: Any) -> dict[str, str]:
        return {}  # written by every process in write_collective

    def write_optimizers(self, ctx: Checkpointable, put: Any, states: Any) -> None:
        pass  # written by every process in write_collective

    # ------------------------------------------------------------------ load
    def read_collective(
        self, ctx: Checkpointable, directory: str, manifest: dict[str, Any], models: list[torch.nn.Module], out: dict[str, Any]
    ) -> None:
        """Every process reads its shards at this run's number of processes (DCP reshards)."""
        where = f"the checkpoint {directory!r}"
        for i, (model, entry) in enumerate(zip(models, manifest["models"])):
            current = ctx.strategy.model_state_dict(model, full=False, check_filled=False)
            io.compare_tensors(entry["tensors"], io.tensor_table(current), f"{where} (model {i})")
            target = _empty_like(current)
            with _dcp() as dcp:
                dcp.load(target, checkpoint_id=os.path.join(directory, entry["dir"]), no_dist=_no_dist())
            out["models"].append(target)
        for i, opt in enumerate(ctx.registry.optimizers):
            # torch creates the state of an optimizer that has not stepped yet (a step with lr 0) to
            # have tensors to load into; its values are replaced by the checkpoint's in restore.
            target = _empty_like(ctx.strategy.optimizer_state_dict(opt, full=False))
            with _dcp() as dcp:
                dcp.load(target, checkpoint_id=os.path.join(directory, f"optimizer_{i}"), no_dist=_no_dist())
            out["optimizers"].append(target)

    def read_models(self, ctx: Checkpointable, directory: str, manifest: dict[str, Any], models: Any, out: Any, weights_only: bool) -> None:
        pass  # read by every process in read_collective

    def read_optimizers(self, ctx: Checkpointable, load: Any, out: dict[str, Any], where: str) -> None:
        pass  # read by every process in read_collective


LAYOUT = DCPLayout()
