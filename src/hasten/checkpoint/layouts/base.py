"""What hasten's own layouts ("full", "dcp") share: everything but the models and optimizers.

::

    scheduler.bin ...        state_dict of each prepared LR scheduler
    custom_checkpoint_0.pkl  state_dict of each object given to register_for_checkpointing
    scaler.pt                the fp16 GradScaler (scale, growth tracker), when there is one
    loop_state.json          step counters: accelerator.step, accumulation micro-step, and
                             each optimizer's real/sync step counts
    random_states_0.pkl ...  per process: RNG states (Python, NumPy, torch CPU, every CUDA
                             device) and the position of every prepared dataloader
    fault_tolerance.pt       with FaultToleranceKwargs: torchft's committed step (and semi_sync's state)
    fault_tolerance_groups_0.pt ...  with FaultToleranceKwargs, per process: every replica group's
                             states of the file above (the groups exchange them at save_state, one
                             group writes the folder); each group reads its own back

The names are the layout's (``file_names``: Accelerate's for "full", hasten's first ones,
``scheduler_0.pt``, ``custom_0.pt``, ``rank_0.pt``..., for "dcp"; see ``names``), and a
checkpoint is read with those its manifest's ``file_names`` says (absent in checkpoints of
earlier versions, which have hasten's). A layout (``HastenLayout`` subclass) says where the models and optimizers go
(``plan_weights``) and reads them back (``read_weights``); the rest, its checks and the manifest
fields are here. Reading checks the world size, object counts, file sizes and checksums, tensor
names and shapes, optimizer groups and the scaler before anything is restored; at another
number of processes than saved (refused with ``strict_world_size=True``) every process reads
rank 0's dataloader positions (global ones) and, if the saving run had a process of its rank,
that process's RNG states. A replica group (FaultToleranceKwargs) that the groups' file lacks
continues the writing group's positions and RNG states, with a warning.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import restore, storage
from hasten.checkpoint.layouts.names import HASTEN, LOOP_STATE, FileNames, names_of
from hasten.checkpoint.manifest import check_files
from hasten.checkpoint.plans import FileWrite, ManifestFields, Restore, SavePlan, ShardedWrite
from hasten.data_loader.position import check_loader_state
from hasten.training.rng import _MAX_SEED, capture_rng_state, check_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from hasten.checkpoint.context import Checkpointable
    from hasten.checkpoint.plans import LoadOptions

SCALER = "scaler.pt"
FAULT_TOLERANCE = "fault_tolerance.pt"  # torchft's committed step (FaultToleranceKwargs)


def fault_tolerance_groups(rank: int) -> str:
    """Process ``rank``'s file of every replica group's ``rank_state`` (FaultToleranceKwargs)."""
    return f"fault_tolerance_groups_{rank}.pt"


_REQUIRED = ("world_size", "counts", "models", "files", "scaler")
_HINT = " (objects other than tensors/containers need load_state(..., weights_only=False) for a trusted checkpoint)"


class HastenLayout:
    """A layout of hasten's own: a manifest, the shared files above, and the models and optimizers
    where the subclass puts them."""

    name = ""
    writable = True
    #: the names (and forms) of the files this layout writes; reading follows the manifest's
    file_names: FileNames = HASTEN
    #: whether every process reads the models and optimizers together (sharded files: before any
    #: check that could fail on one process only), else each reads them once its files are verified
    collective_read = False
    resize_hint = " (strict_world_size=False, the default, resumes at this number from the global dataloader positions)"

    def recognises(self, directory: str) -> bool:
        return False  # hasten's own layout: recognised by its manifest

    # ------------------------------------------------------------------ save
    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def plan_weights(
        self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool
    ) -> tuple[list[ShardedWrite], list[FileWrite], list[dict[str, Any]]]:
        """The models and optimizers: sharded folders (every process), files (this process's) and,
        on the main process, each model's manifest entry (its file or folder, its tensor table)."""
        raise NotImplementedError

    def plan_save(self, ctx: Checkpointable, weights: list[dict[str, Any]], safe: bool) -> SavePlan:
        sharded, files, models = self.plan_weights(ctx, weights, safe)
        plan = SavePlan(sharded=sharded, files=files)
        if ctx.state.is_main_process:  # the shared files and the manifest's fields come from the main process
            plan.files += _shared_files(ctx, self.file_names)
            plan.manifest = ManifestFields(
                world_size=ctx.state.num_processes,
                mixed_precision=ctx.precision.mode,
                scaler=ctx.precision.scaler is not None,
                step=ctx.step,
                counts=ctx.registry.counts(),
                models=models,
                file_names=self.file_names.name,
            )
        names, rank = self.file_names, ctx.state.process_index
        own = rank_state(ctx)
        plan.files.append(FileWrite(names.rank(rank), names.rank_state(own, ctx.gradient_state.micro_step)))
        ft = ctx.fault_tolerance
        if ft is not None and ft.saved_groups is not None:  # every replica group's, for each to take its own
            groups = {"rank": rank, "writer": ft.handler.replica_group, "groups": ft.saved_groups}
            plan.files.append(FileWrite(fault_tolerance_groups(rank), groups))
        return plan

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
        """Read the models and optimizers into ``r.models``/``r.optimizers`` (``load``: the torch
        file reader, None where ``collective_read``)."""
        raise NotImplementedError

    def read_verifies(self, file_name: str) -> bool:
        """Whether ``file_name`` is verified (its checksum) by the reader that reads it, not beforehand."""
        return False

    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        options: LoadOptions,
    ) -> Restore:
        """Everything ``restore`` applies, read and checked; nothing is changed yet."""
        assert manifest is not None
        where = f"the checkpoint {directory!r}"
        self._check_fits(ctx, manifest, where, options.strict_world_size)
        names = names_of(manifest, where)
        state = ctx.state
        same_size = manifest["world_size"] == state.num_processes
        rank_file = names.rank(state.process_index)
        own_rng = same_size or state.process_index < manifest["world_size"]
        check_files(
            directory, manifest, where, checksums=False
        )  # sizes now; checksums of what this process reads below
        files = manifest["files"]
        r = Restore(where)
        if len(models) != len(manifest["models"]):
            raise ValueError(
                f"{where} holds the weights of {len(manifest['models'])} model(s), but {len(models)} are left to "
                "restore (the prepared models less those the load_state pre-hooks took out of the list)"
            )
        # each optimizer's parameter names over the whole model (a collective under pipeline parallelism)
        r.optimizer_names = [ctx.strategy.optimizer_names(o) for o in ctx.registry.optimizers]
        if self.collective_read:  # collective reads come before any check that could fail on one process only
            self.read_weights(ctx, directory, manifest, models, None, r, options)
        needed = {rank_file} if own_rng else set()
        if not same_size:
            needed.add(names.rank(0))
        # What this process reads, less what the layout's readers verify as they read (``read_verifies``).
        mine = [f for f in files if (not names.is_rank(f) or f in needed) and not self.read_verifies(f)]
        for f in sorted(needed):
            if f not in files:
                raise ValueError(f"{where} is incomplete: it has no {f!r}")
        if options.verify_checksums:
            check_files(directory, manifest, where, mine)
        load = restore.torch_files(directory, where, options.weights_only, _HINT if options.weights_only else "")
        if not self.collective_read:
            self.read_weights(ctx, directory, manifest, models, load, r, options)
        _read_shared(ctx, directory, load, r, manifest["world_size"], own_rng, names)
        if ctx.fault_tolerance is not None and FAULT_TOLERANCE in files:
            r.fault_tolerance = load(FAULT_TOLERANCE)
            _own_group(ctx, load, r, files, same_size, own_rng)
        return r

    def _check_fits(self, ctx: Checkpointable, manifest: dict[str, Any], where: str, strict_world_size: bool) -> None:
        """The manifest has what this layout reads, and its counts of objects, its GradScaler and
        (with ``strict_world_size``) its number of processes are this run's."""
        for key in _REQUIRED:
            if key not in manifest:
                raise ValueError(f"load_state: the manifest of {where} lacks {key!r}")
        state = ctx.state
        if manifest["world_size"] != state.num_processes and strict_world_size:
            raise ValueError(
                f"{where} was saved by {manifest['world_size']} process(es) but this run has "
                f"{state.num_processes}, and load_state(..., strict_world_size=True) asks for the same number"
                + self.resize_hint
            )
        counts = ctx.registry.counts()
        if manifest["counts"] != counts:
            diff = ", ".join(
                f"{k}: checkpoint {manifest['counts'].get(k)} vs prepared {n}"
                for k, n in counts.items()
                if manifest["counts"].get(k) != n
            )
            raise ValueError(f"{where} holds other objects than were prepared/registered ({diff})")
        has_scaler = ctx.precision.scaler is not None
        if manifest["scaler"] != has_scaler:
            raise ValueError(
                f"{where} was saved with mixed_precision={manifest.get('mixed_precision')!r} "
                f"{'with' if manifest['scaler'] else 'without'} a GradScaler, but this Accelerator has "
                f"mixed_precision={ctx.precision.mode!r} {'with' if has_scaler else 'without'} one"
            )

    def restore(self, ctx: Checkpointable, r: Restore, directory: str, models: list[torch.nn.Module]) -> None:
        """Apply what ``read`` checked (``restore.apply``: registered objects first, and a failure
        after them says what had changed)."""
        restore.apply(ctx, r, directory, models)


def _shared_files(ctx: Checkpointable, names: FileNames) -> list[FileWrite]:
    """The files only the main process writes, besides the models and optimizers."""
    registry = ctx.registry
    out = [FileWrite(names.scheduler(i), sched.state_dict()) for i, sched in enumerate(registry.schedulers)]
    out += [FileWrite(names.custom(i), obj.state_dict()) for i, obj in enumerate(registry.custom_objects)]
    if ctx.precision.scaler is not None:
        out.append(FileWrite(SCALER, names.scaler_state(ctx.precision.state_dict())))
    if ctx.fault_tolerance is not None:
        out.append(FileWrite(FAULT_TOLERANCE, ctx.fault_tolerance.state_dict()))
    loop = {
        "step": ctx.step,
        "global_batch": global_batch(ctx),
        "micro_step": ctx.gradient_state.micro_step,
        "optimizers": [{"real_steps": o.real_steps, "sync_steps": o.sync_steps} for o in registry.optimizers],
    }
    out.append(FileWrite(LOOP_STATE, loop, "json"))
    return out


def _read_shared(
    ctx: Checkpointable, directory: str, load: Any, r: Restore, saved_n: int, own_rng: bool, names: FileNames
) -> None:
    """The schedulers, registered objects, scaler, loop counters and this process's file, into ``r``."""
    state, counts, where = ctx.state, ctx.registry.counts(), r.where
    same_size = saved_n == state.num_processes
    has_scaler = ctx.precision.scaler is not None
    r.schedulers = [load(names.scheduler(i)) for i in range(counts["schedulers"])]
    r.custom = [load(names.custom(i)) for i in range(counts["custom_objects"])]
    r.scaler = names.read_scaler(load(SCALER)) if has_scaler else None
    with storage.open(os.path.join(directory, LOOP_STATE), "rb") as f:  # the local disk or a URL
        loop = json.loads(f.read())
    if len(loop.get("optimizers", [])) != counts["optimizers"]:
        raise ValueError(f"{where}: {LOOP_STATE} does not match the number of optimizers")
    r.micro_step, r.optimizer_counters = loop.get("micro_step", 0), loop.get("optimizers", [])
    _rank_state(ctx, load, r, same_size, own_rng, names)
    if has_scaler and not (isinstance(r.scaler, dict) and isinstance(r.scaler.get("scaler"), dict)):
        raise ValueError(f"{where}: {SCALER!r} does not hold a GradScaler state")
    old, new = loop.get("global_batch"), global_batch(ctx)
    if not same_size and state.is_main_process and old is not None and new is not None and old != new:
        r.warning = (  # load_state warns once it restored everything (on the main process)
            f"load_state: the checkpoint was saved by {saved_n} process(es), this run has "
            f"{state.num_processes}: the global batch size changes from {old} to {new} "
            "(per-process batch x processes x gradient accumulation)"
        )


def _rank_state(ctx: Checkpointable, load: Any, r: Restore, same_size: bool, own_rng: bool, names: FileNames) -> None:
    """What ``restore`` applies of the per-process files (``names.rank(N)``, read and checked with
    ``load``), into ``r``: the dataloader positions (rank 0's, global ones, at another number of
    processes), this process's RNG states if the saving run had its rank (``own_rng``), else the
    seed to derive them from."""
    state, counts, where = ctx.state, ctx.registry.counts(), r.where
    rank_file = names.rank(state.process_index)

    def load_rank(i: int) -> dict[str, Any]:
        name = names.rank(i)
        rank = names.read_rank(load, i, where)
        if not isinstance(rank, dict) or rank.get("rank") != i:
            raise ValueError(f"{where}: {name!r} does not hold process {i}'s state")
        if len(rank.get("dataloaders", [])) != counts["dataloaders"] or "rng" not in rank:
            raise ValueError(f"{where}: {name!r} does not match the prepared dataloaders")
        return rank

    rank = load_rank(state.process_index) if own_rng else None
    # At another size every process continues rank 0's (global) dataloader positions.
    positions = load_rank(0) if not same_size else rank
    assert positions is not None
    data_file = rank_file if same_size else names.rank(0)
    for i, (loader, position) in enumerate(zip(ctx.registry.dataloaders, positions["dataloaders"])):
        check_loader_state(loader, position, f"{where} ({data_file}, dataloader {i})", resized=not same_size)
    if rank is not None:
        try:
            check_rng_state(rank["rng"], f"{where} ({rank_file})")
        except RuntimeError as e:
            raise ValueError(str(e)) from e
    seed = positions.get("seed")
    derived = None if rank is not None else (int(seed) if isinstance(seed, int) else 0) + state.process_index
    r.dataloaders = positions["dataloaders"]
    r.rng = rank["rng"] if rank is not None else None
    r.derived_seed = None if derived is None else derived % (_MAX_SEED + 1)


def rank_state(ctx: Checkpointable) -> dict[str, Any]:
    """This process's own part of a checkpoint: its rank, RNG states, seed and dataloader positions."""
    return {
        "rank": ctx.state.process_index,
        "rng": capture_rng_state(),
        "seed": torch.initial_seed(),  # new ranks of a larger run derive their RNG states from it
        "dataloaders": [dl.state_dict() for dl in ctx.registry.dataloaders],
    }


def _own_group(ctx: Checkpointable, load: Any, r: Restore, files: Any, same_size: bool, own_rng: bool) -> None:
    """With FaultToleranceKwargs: this replica group's own dataloader positions and RNG states (from
    ``fault_tolerance_groups_N.pt``, as ``_rank_state`` takes them from the rank files) in ``r`` in
    place of the writing group's. A folder without that file (saved by one group for itself) is
    left as read; a group it lacks keeps the writing group's, with a warning."""
    state, where = ctx.state, r.where
    group = ctx.fault_tolerance.handler.replica_group

    def own(i: int) -> dict[str, Any] | None:
        name = fault_tolerance_groups(i)
        if name not in files:
            return None
        saved = load(name)
        groups = saved.get("groups") if isinstance(saved, dict) else None
        if not isinstance(groups, dict) or saved.get("rank") != i:
            raise ValueError(f"{where}: {name!r} does not hold the replica groups' states of process {i}")
        if group not in groups:
            if state.is_main_process and i == 0:
                r.warning = (r.warning + "; " if r.warning else "") + (
                    f"load_state: {where} holds the positions of replica groups {sorted(groups)}, not of this "
                    f"group {group}: it continues replica group {saved.get('writer')}'s dataloader positions "
                    "and RNG states"
                )
            return None
        mine = groups[group]
        if len(mine.get("dataloaders", [])) != len(ctx.registry.dataloaders) or "rng" not in mine:
            raise ValueError(f"{where}: {name!r} does not match the prepared dataloaders (replica group {group})")
        return mine

    positions = own(state.process_index if same_size else 0)
    if positions is None:
        return
    for i, (loader, position) in enumerate(zip(ctx.registry.dataloaders, positions["dataloaders"])):
        check_loader_state(loader, position, f"{where} (replica group {group}, dataloader {i})", resized=not same_size)
    r.dataloaders = positions["dataloaders"]
    rng = positions if same_size else (own(state.process_index) if own_rng else None)
    if rng is not None:
        try:
            check_rng_state(rng["rng"], f"{where} (replica group {group})")
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        r.rng = rng["rng"]
    elif not own_rng and isinstance(positions.get("seed"), int):
        r.derived_seed = (positions["seed"] + state.process_index) % (_MAX_SEED + 1)


def owner_shapes(
    optimizer: Any, models: list[torch.nn.Module], shapes: list[dict[str, list[int]]]
) -> dict[str, list[int]]:
    """The whole shapes ``restore.match_optimizer`` checks ``optimizer``'s state against: those of
    the one model among ``models`` whose parameters it updates (``shapes``: each model's, by its
    own names; two models may both have a "0.weight"), else every model's together."""
    inner = getattr(optimizer, "optimizer", optimizer)
    mine = {id(p) for group in inner.param_groups for p in group["params"]}
    owners = [i for i, m in enumerate(models) if any(id(p) in mine for p in m.parameters())]
    if len(owners) == 1:
        return shapes[owners[0]]
    return {k: shape for table in shapes for k, shape in table.items()}


def global_batch(ctx: Checkpointable) -> int | None:
    """Samples per optimizer step over all processes: the first prepared dataloader's per-process
    batch x data-parallel processes x gradient accumulation (None without a dataloader that has a batch size)."""
    loaders = ctx.registry.dataloaders
    size = loaders[0]._batch_size() if loaders else None
    if size is None:
        return None
    split = loaders[0].split_batches
    per_step = size if split else size * loaders[0]._num_processes()  # the data-parallel ranks (not TP ranks)
    return int(per_step * ctx.gradient_state.num_steps)
