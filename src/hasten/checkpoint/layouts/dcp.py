"""The "dcp" layout: models and optimizers sharded with ``torch.distributed.checkpoint``.

::

    model_0/                 torch.distributed.checkpoint folder of each prepared model: every
      .metadata              process writes its own shards (``__R_0.distcp``), in parallel; keys
      __0_0.distcp ...       are the model's own (no wrapper prefixes)
    optimizer_0/             the same for each optimizer, keyed by parameter names
    (the rest)               as in the "full" layout: schedulers, scaler, registered objects,
                             loop_state.json and rank_N.pt (RNG states, dataloader positions)

Written by the FSDP strategy (``state_dict_type="SHARDED_STATE_DICT"``, also on one process)
and pipeline parallelism. ``torch.distributed.checkpoint`` reshards on load, so the models and
optimizers load at any number of processes and into any strategy: each process reads what its
target holds (its shards as DTensors; whole tensors for one process or DDP, into new tensors,
the optimizers keyed by parameter names), and into a plain model with ``hasten merge-weights``.
Before ``dcp.load`` every optimizer's saved items are matched against the prepared optimizer
(its parameters and state keys), after it its parameter groups (``restore.match_optimizer``).
The per-process files are read as in the "full" layout (rank 0's global dataloader positions at
another number).
Everything but the models and optimizers is ``base``'s, as for the "full" layout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import dcp_io, errors, unpickle
from hasten.checkpoint.layouts.base import HastenLayout, owner_shapes
from hasten.checkpoint.manifest import check_files, region_digests
from hasten.checkpoint.plans import FileWrite, ShardedWrite
from hasten.checkpoint.restore import match_optimizer, state_keys
from hasten.checkpoint.weights import compare_tensors, tensor_table

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions, Restore


def _empty_like(obj: Any) -> Any:
    """A structure like ``obj`` whose tensors are new (DTensors keep their sharding), for loading into."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_like(x) for k, x in obj.items()}
    if isinstance(obj, list):
        return [_empty_like(x) for x in obj]
    return obj


def _reader(directory: str, folder: str, manifest: dict[str, Any], where: str, verify: bool) -> Any:
    """``dcp_io.dcp_reader`` of ``directory/folder``; with ``verify``, each file this process reads is
    there at its size, and each item it reads is checked against its checksum in the manifest
    as it is read (in a checkpoint of an earlier version, the whole file, first)."""

    def check(name: str, regions: list[tuple[int, int]] | None) -> dict[tuple[int, int], str] | None:
        if not verify:
            return None
        file_name = f"{folder}/{name}"
        digests = None if regions is None else region_digests(manifest, file_name, regions)
        check_files(directory, manifest, where, [file_name], checksums=digests is None)
        return digests

    return dcp_io.dcp_reader(os.path.join(directory, folder), check, where)


def _load(
    target: Any,
    directory: str,
    folder: str,
    manifest: dict[str, Any],
    where: str,
    verify: bool,
    *,
    reader: Any = None,
    weights_only: bool = True,
) -> None:
    """``dcp.load`` of ``directory/folder`` into ``target`` (new tensors: the model and optimizer
    are filled from them only after everything was read), with ``reader`` (``_reader``, its
    ``.metadata`` read already; made and read here where None). Nothing is unpickled but through
    the allow-lists of ``unpickle``: ``.metadata`` always, the non-tensor items with
    ``torch.load(weights_only=weights_only)``. A damaged or unsafe file is the
    ``DamagedCheckpoint``/``UnsafeCheckpoint`` naming it, the same on every process."""
    if reader is None:
        reader = _reader(directory, folder, manifest, where, verify)
        reader.read_metadata()  # here, not inside dcp.load: a bad file is one error, not torch's fallback and log
    try:
        planner = unpickle.dcp_planner(reader, where, weights_only)
        dcp_io.dcp().load(target, storage_reader=reader, planner=planner, no_dist=dcp_io.no_dist())
    except BaseException as e:
        damaged = next((c for c in errors._causes(e) if isinstance(c, errors.DamagedCheckpoint)), None)
        if damaged is None:
            raise
        raise type(damaged)(str(damaged)) from None  # the same error on every process


def _check_saved_state(metadata: Any, names: list[list[str]], keys: list[set[str] | None], what: str) -> None:
    """Each parameter's state in an optimizer's DCP folder (``state.<name>.<key>`` items) is one
    the prepared optimizer has, with its keys (``dcp.load`` itself refuses what the target has
    and the folder lacks, not the reverse); ``names``/``keys``: as ``restore.match_optimizer``'s."""
    group_of = {n: g for g, group in enumerate(names) for n in group}
    saved: dict[str, set[str]] = {}
    for item in getattr(metadata, "state_dict_metadata", {}):
        if item.startswith("state."):
            name, _, key = item[len("state.") :].rpartition(".")
            saved.setdefault(name, set()).add(key)
    for name, found in saved.items():
        if name not in group_of:
            raise ValueError(f"{what} holds a state for {name!r}, which the prepared optimizer does not update")
        expected = keys[group_of[name]] if group_of[name] < len(keys) else None
        if expected is not None and found != expected:
            raise ValueError(
                f"{what}: the state of {name!r} has the keys {sorted(found)}, the prepared optimizer's "
                f"{sorted(expected)} (another optimizer class or settings than saved)"
            )


class DCPLayout(HastenLayout):
    name = "dcp"
    collective_read = True
    resize_hint = (
        " (strict_world_size=False, the default, reshards the models and optimizers of this sharded "
        "checkpoint and resumes from the global dataloader positions)"
    )

    # ------------------------------------------------------------------ save
    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """This process's shards (DTensors with the global shapes); no gathering."""
        return [ctx.strategy.model_state_dict(m, full=False) for m in models]

    def plan_weights(
        self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool
    ) -> tuple[list[ShardedWrite], list[FileWrite], list[dict[str, Any]]]:
        """Every process's shards of each model and optimizer, a DCP folder each."""
        sharded = [ShardedWrite(f"model_{i}", sd) for i, sd in enumerate(weights)]
        sharded += [
            ShardedWrite(f"optimizer_{i}", ctx.strategy.optimizer_state_dict(opt, full=False))
            for i, opt in enumerate(ctx.registry.optimizers)
        ]
        # the whole model's names and shapes (a pipeline stage's process holds part of it)
        prepared = ctx.registry.models
        tables = [
            ctx.strategy.whole_tensor_table(prepared[i], tensor_table(sd)) if i < len(prepared) else tensor_table(sd)
            for i, sd in enumerate(weights)
        ]
        models = [{"dir": f"model_{i}", "tensors": table} for i, table in enumerate(tables)]
        return sharded, [], models

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
        """Every process reads its shards at this run's number of processes (DCP reshards),
        verifying (``verify_checksums``) each item it reads against its checksum as it reads it;
        the non-tensor items (``param_groups`` values) through torch's allow-list (``weights_only``)."""
        where, verify, weights_only = r.where, options.verify_checksums, options.weights_only
        folders = [entry["dir"] for entry in manifest["models"][: len(models)]]
        folders += [f"optimizer_{i}" for i in range(len(ctx.registry.optimizers))]

        def metadata() -> dict[str, Any]:
            readers = {folder: _reader(directory, folder, manifest, where, verify) for folder in folders}
            for reader in readers.values():
                reader.read_metadata()  # verified and allow-listed; dcp.load gets the same objects
            return readers

        # Every process reads every .metadata before dcp.load: a damaged or unsafe one is one
        # error on every process (inside dcp.load, torch's fallback and per-rank tracebacks).
        readers = ctx.agree("load_state (reading the metadata of the sharded files)", metadata)
        for i, (model, entry) in enumerate(zip(models, manifest["models"])):
            current = ctx.strategy.model_state_dict(model, full=False, check_filled=False)
            whole = ctx.strategy.whole_tensor_table(model, tensor_table(current))
            compare_tensors(entry["tensors"], whole, f"{where} (model {i})")
            target = _empty_like(current)
            reader = readers[entry["dir"]]
            _load(target, directory, entry["dir"], manifest, where, verify, reader=reader, weights_only=weights_only)
            r.models.append(target)
        shapes = [{k: t["shape"] for k, t in entry["tensors"].items()} for entry in manifest["models"][: len(models)]]
        for i, opt in enumerate(ctx.registry.optimizers):
            # torch creates the state of an optimizer that has not stepped yet (a step with lr 0) to
            # have tensors to load into; its values are replaced by the checkpoint's in restore.
            target = _empty_like(ctx.strategy.optimizer_state_dict(opt, full=False))
            folder = f"optimizer_{i}"
            names, keys = r.optimizer_names[i], state_keys(opt)
            _check_saved_state(readers[folder].read_metadata(), names, keys, f"{where}: optimizer {i}")
            _load(target, directory, folder, manifest, where, verify, reader=readers[folder], weights_only=weights_only)
            whole = owner_shapes(opt, models, shapes)
            r.optimizers.append(match_optimizer(i, target, names, keys, whole, where))

    def read_verifies(self, file_name: str) -> bool:
        return "/" in file_name and file_name.startswith(("model_", "optimizer_"))


LAYOUT = DCPLayout()
