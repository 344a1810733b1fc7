"""The "full" layout: full weights and shared state from the main process, one file per process.

::

    model_0.safetensors      full weights of each prepared model, with the model's own keys
                             (model_0.bin with safe_serialization=False)
    optimizer_0.pt           state_dict of each prepared optimizer
    scheduler_0.pt           state_dict of each prepared LR scheduler
    custom_0.pt              state_dict of each object given to register_for_checkpointing
    scaler.pt                the fp16 GradScaler (scale, growth tracker), when there is one
    loop_state.json          step counters: accelerator.step, accumulation micro-step, and
                             each optimizer's real/sync step counts
    rank_0.pt ... rank_N.pt  per process: RNG states (Python, NumPy, torch CPU, every CUDA
                             device) and the position of every prepared dataloader

Reading checks the world size, object counts, file sizes and checksums, tensor names and
shapes, optimizer groups and the scaler before anything is restored.
"""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any

import torch

from ...data_loader.core import check_loader_state
from ...rng import _MAX_SEED, capture_rng_state, check_rng_state, restore_rng_state, set_seed
from .. import io, unpickle
from ..errors import UnsafeCheckpoint
from ..manifest import check_files

if TYPE_CHECKING:  # pragma: no cover
    from ..context import Checkpointable

LOOP_STATE = "loop_state.json"
SCALER = "scaler.pt"
_REQUIRED = ("world_size", "counts", "models", "files", "scaler")


def model_file(i: int, safe: bool) -> str:
    return f"model_{i}.safetensors" if safe else f"model_{i}.bin"


class FullLayout:
    name = "full"
    writable = True

    def recognises(self, directory: str) -> bool:
        return False  # hasten's own layout: recognised by its manifest

    # ------------------------------------------------------------------ save
    def weights(self, ctx: Checkpointable, models: list[torch.nn.Module]) -> list[dict[str, Any]]:
        """The models' state dicts the save pre-hooks see and ``write`` saves: full ones here."""
        return [ctx.strategy.model_state_dict(m) for m in models]

    def write(
        self, ctx: Checkpointable, tmp: str, weights: list[dict[str, Any]], *, safe: bool = True, stage: Any = None
    ) -> tuple[dict[str, str], dict[str, Any], list[Any]]:
        info: dict[str, Any] = {}
        jobs: list[Any] = []
        written = self.write_collective(ctx, tmp, weights, info, stage, jobs)
        if not ctx.state.is_main_process:
            info = {}  # the manifest's fields come from the main process
        else:
            written.update(self._write_shared(ctx, tmp, safe, info, weights, stage, jobs))
            info.update(
                world_size=ctx.state.num_processes,
                mixed_precision=ctx.precision.mode,
                scaler=ctx.precision.scaler is not None,
                step=ctx.step,
                counts=ctx.registry.counts(),
            )
        rank_file = f"rank_{ctx.state.process_index}.pt"
        path = os.path.join(tmp, rank_file)
        rank_state = {
            "rank": ctx.state.process_index,
            "rng": capture_rng_state(),
            "seed": torch.initial_seed(),  # new ranks of a larger run derive their RNG states from it
            "dataloaders": [dl.state_dict() for dl in ctx.registry.dataloaders],
        }
        io.write(path, lambda f: torch.save(rank_state, f))
        written[rank_file] = path
        return written, info, jobs

    def write_collective(
        self, ctx: Checkpointable, tmp: str, weights: list[dict[str, Any]], info: dict[str, Any], stage: Any, jobs: list[Any]
    ) -> dict[str, str]:
        """What every process does together: here, the optimizers' full state dicts (gathering them
        is a collective under a sharding strategy), which the main process then writes.

        ``stage`` (an asynchronous save): a ``Future`` of a state dict's copy in host memory
        (``background.Staging``); the large files are then written by ``jobs`` (``job(group) ->
        {file name: path}``) in the background thread, from the copies. Without it everything is written now."""
        info["optimizers"] = [ctx.strategy.optimizer_state_dict(o) for o in ctx.registry.optimizers]
        return {}

    def write_models(
        self, ctx: Checkpointable, tmp: str, safe: bool, info: dict[str, Any], weights: list[dict[str, Any]],
        stage: Any, jobs: list[Any],
    ) -> dict[str, str]:
        """The models' files, written by the main process (in ``jobs``, from staged copies, where
        the save is asynchronous); fills ``info["models"]`` for the manifest."""
        written: dict[str, str] = {}
        info["models"] = []
        for i, sd in enumerate(weights):
            file_name = model_file(i, safe)
            path = os.path.join(tmp, file_name)
            info["models"].append({"file": file_name, "tensors": io.tensor_table(sd)})
            if stage is None:
                io.write_weights(path, sd, safe, "save_state")
                written[file_name] = path
            else:
                staged = stage(sd)
                jobs.append(lambda group, path=path, staged=staged, file_name=file_name: (
                    io.write_weights(path, staged.result(), safe, "save_state"), {file_name: path})[1])
        return written

    def write_optimizers(self, ctx: Checkpointable, put: Any, states: list[dict[str, Any]]) -> None:
        for i, sd in enumerate(states):
            put(f"optimizer_{i}.pt", sd, True)

    def _write_shared(
        self, ctx: Checkpointable, tmp: str, safe: bool, info: dict[str, Any], weights: list[dict[str, Any]],
        stage: Any, jobs: list[Any],
    ) -> dict[str, str]:
        """The files only the main process writes; fills ``info["models"]`` for the manifest. With
        ``stage``, the models and optimizers go to ``jobs``; the rest (small) is written now."""
        written: dict[str, str] = {}
        registry = ctx.registry

        def put(file_name: str, obj: Any, large: bool = False) -> None:
            path = os.path.join(tmp, file_name)
            if large and stage is not None:
                staged = stage(obj)
                jobs.append(lambda group: (io.write(path, lambda f: torch.save(staged.result(), f)), {file_name: path})[1])
                return
            io.write(path, lambda f: torch.save(obj, f))
            written[file_name] = path

        written.update(self.write_models(ctx, tmp, safe, info, weights, stage, jobs))
        self.write_optimizers(ctx, put, info.pop("optimizers") or [])
        for i, sched in enumerate(registry.schedulers):
            put(f"scheduler_{i}.pt", sched.state_dict())
        for i, obj in enumerate(registry.custom_objects):
            put(f"custom_{i}.pt", obj.state_dict())
        if ctx.precision.scaler is not None:
            put(SCALER, ctx.precision.state_dict())
        loop = {
            "step": ctx.step,
            "global_batch": global_batch(ctx),
            "micro_step": ctx.gradient_state.micro_step,
            "optimizers": [{"real_steps": o.real_steps, "sync_steps": o.sync_steps} for o in registry.optimizers],
        }
        path = os.path.join(tmp, LOOP_STATE)
        io.write_json(path, loop)
        written[LOOP_STATE] = path
        return written

    # ------------------------------------------------------------------ load
    def read(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any] | None,
        models: list[torch.nn.Module],
        weights_only: bool,
        verify_checksums: bool,
        strict_world_size: bool = False,
    ) -> dict[str, Any]:
        """Everything ``restore`` applies, read and checked; nothing is changed yet.

        At another number of processes than saved (refused with ``strict_world_size=True``),
        every process reads rank 0's dataloader positions (global ones) and, if the saving run
        had a process of its rank, that process's RNG states.
        """
        assert manifest is not None
        where = f"the checkpoint {directory!r}"
        self._check_fits(ctx, manifest, where, strict_world_size)
        state, counts = ctx.state, ctx.registry.counts()
        same_size = manifest["world_size"] == state.num_processes
        has_scaler = ctx.precision.scaler is not None
        saved_n = manifest["world_size"]
        rank_file = f"rank_{state.process_index}.pt"
        own_rng = same_size or state.process_index < saved_n
        check_files(directory, manifest, where, checksums=False)  # sizes now; checksums of what this process reads below
        files = manifest["files"]
        out: dict[str, Any] = {"models": [], "optimizers": [], "schedulers": [], "custom": []}
        if len(models) != len(manifest["models"]):
            raise ValueError(
                f"{where} holds the weights of {len(manifest['models'])} model(s), but {len(models)} are left to "
                "restore (the prepared models less those the load_state pre-hooks took out of the list)"
            )
        # Collective reads come before any check that could fail on one process only.
        self.read_collective(ctx, directory, manifest, models, out, verify_checksums, weights_only)
        needed = {rank_file} if own_rng else set()
        if not same_size:
            needed.add("rank_0.pt")
        # What this process reads, less what the layout's readers verify as they read (``read_verifies``).
        mine = [f for f in files if (not f.startswith("rank_") or f in needed) and not self.read_verifies(f)]
        for f in sorted(needed):
            if f not in files:
                raise ValueError(f"{where} is incomplete: it has no {f!r}")
        if verify_checksums:
            check_files(directory, manifest, where, mine)

        load = _loader(directory, where, weights_only)
        self.read_models(ctx, directory, manifest, models, out, weights_only)
        self.read_optimizers(ctx, load, out, where)
        out["schedulers"] = [load(f"scheduler_{i}.pt") for i in range(counts["schedulers"])]
        out["custom"] = [load(f"custom_{i}.pt") for i in range(counts["custom_objects"])]
        out["scaler"] = load(SCALER) if has_scaler else None
        with open(os.path.join(directory, LOOP_STATE), encoding="utf-8") as f:
            out["loop"] = json.load(f)
        if len(out["loop"].get("optimizers", [])) != counts["optimizers"]:
            raise ValueError(f"{where}: {LOOP_STATE} does not match the number of optimizers")
        out["rank"] = _rank_state(ctx, load, where, same_size, own_rng)
        if has_scaler and not (isinstance(out["scaler"], dict) and isinstance(out["scaler"].get("scaler"), dict)):
            raise ValueError(f"{where}: {SCALER!r} does not hold a GradScaler state")
        old, new = out["loop"].get("global_batch"), global_batch(ctx)
        out["warning"] = None  # load_state warns once it restored everything (on the main process)
        if not same_size and state.is_main_process and old is not None and new is not None and old != new:
            out["warning"] = (
                f"load_state: the checkpoint was saved by {saved_n} process(es), this run has "
                f"{state.num_processes}: the global batch size changes from {old} to {new} "
                "(per-process batch x processes x gradient accumulation)"
            )
        return out

    resize_hint = (
        " (strict_world_size=False, the default, resumes at this number from the global dataloader positions)"
    )

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

    def read_collective(
        self, ctx: Checkpointable, directory: str, manifest: dict[str, Any], models: list[torch.nn.Module],
        out: dict[str, Any], verify: bool = True, weights_only: bool = True,
    ) -> None:
        """What every process reads together (a sharded layout's models and optimizers): nothing here."""

    def read_verifies(self, file_name: str) -> bool:
        """Whether ``file_name`` is verified (its checksum) by the reader that reads it, not beforehand."""
        return False

    def read_models(
        self,
        ctx: Checkpointable,
        directory: str,
        manifest: dict[str, Any],
        models: list[torch.nn.Module],
        out: dict[str, Any],
        weights_only: bool,
    ) -> None:
        where = f"the checkpoint {directory!r}"
        for entry in manifest["models"]:
            if not isinstance(entry, dict) or entry.get("file") not in manifest["files"]:
                named = entry.get("file") if isinstance(entry, dict) else entry
                raise ValueError(
                    f"load_state: the manifest of {where} names a model file {named!r} that its 'files' table "
                    "does not list (so it has no size or checksum to verify)"
                )
        for i, (model, entry) in enumerate(zip(models, manifest["models"])):
            current = io.tensor_table(ctx.strategy.model_state_dict(model, full=False, check_filled=False))
            io.compare_tensors(entry["tensors"], current, f"{where} (model {i})")
            out["models"].append(io.read_weights(io.inside(directory, entry["file"], where), weights_only))
            io.compare_tensors(io.tensor_table(out["models"][-1]), current, f"{where} (model {i} file)")

    def read_optimizers(self, ctx: Checkpointable, load: Any, out: dict[str, Any], where: str) -> None:
        for i, opt in enumerate(ctx.registry.optimizers):
            sd = load(f"optimizer_{i}.pt")
            saved = [len(g["params"]) for g in sd.get("param_groups", [])]
            now = [len(g["params"]) for g in opt.param_groups]
            if saved != now:
                raise ValueError(
                    f"{where}: optimizer {i} has parameter groups of sizes {saved}, the prepared one {now}"
                )
            out["optimizers"].append(sd)

    def restore(self, ctx: Checkpointable, data: dict[str, Any], directory: str, models: list[torch.nn.Module]) -> None:
        """Apply what ``read`` checked. The registered objects (user code) go first: if one of them
        refuses its state, those restored before it are put back and nothing else has changed."""
        restore_custom_objects(ctx.registry.custom_objects, data["custom"], directory)
        registry = ctx.registry
        step = "models"
        try:
            for model, sd in zip(models, data["models"]):
                ctx.strategy.load_model_state_dict(model, sd)
            step = "optimizers"
            for opt, sd, counters in zip(registry.optimizers, data["optimizers"], data["loop"]["optimizers"]):
                ctx.strategy.load_optimizer_state_dict(opt, sd)
                opt.real_steps = int(counters["real_steps"])
                opt.sync_steps = int(counters["sync_steps"])
            step = "schedulers"  # after the optimizers' counters: a scheduler counts their real steps
            for sched, sd in zip(registry.schedulers, data["schedulers"]):
                sched.load_state_dict(sd)
            step = "grad scaler"
            if data["scaler"] is not None:
                ctx.precision.load_state_dict(data["scaler"])
            step = "loop state"
            ctx.gradient_state.micro_step = int(data["loop"].get("micro_step", 0))
            step = "dataloaders"
            for dl, sd in zip(registry.dataloaders, data["rank"]["dataloaders"]):
                dl.load_state_dict(sd)
            step = "RNG states"
            if data["rank"]["rng"] is not None:
                restore_rng_state(data["rank"]["rng"], f"the checkpoint {directory!r}")
            else:  # a process the saving run did not have: states derived from its seed and this rank
                set_seed(data["rank"]["derived_seed"])
        except Exception as e:
            raise RuntimeError(
                f"load_state: restoring the {step} from {directory!r} failed ({type(e).__name__}: {e}); "
                "the objects restored before it were changed, do not continue training from this state"
            ) from e


def _rank_state(ctx: Checkpointable, load: Any, where: str, same_size: bool, own_rng: bool) -> dict[str, Any]:
    """What ``restore`` applies of the per-process files (``rank_N.pt``, read and checked with
    ``load``): the dataloader positions (rank 0's, global ones, at another number of processes),
    this process's RNG states if the saving run had its rank (``own_rng``), else the seed to
    derive them from."""
    state, counts = ctx.state, ctx.registry.counts()
    rank_file = f"rank_{state.process_index}.pt"

    def load_rank(i: int) -> dict[str, Any]:
        name = f"rank_{i}.pt"
        rank = load(name)
        if not isinstance(rank, dict) or rank.get("rank") != i:
            raise ValueError(f"{where}: {name!r} does not hold process {i}'s state")
        if len(rank.get("dataloaders", [])) != counts["dataloaders"] or "rng" not in rank:
            raise ValueError(f"{where}: {name!r} does not match the prepared dataloaders")
        return rank

    rank = load_rank(state.process_index) if own_rng else None
    # At another size every process continues rank 0's (global) dataloader positions.
    positions = load_rank(0) if not same_size else rank
    assert positions is not None
    data_file = rank_file if same_size else "rank_0.pt"
    for i, (loader, position) in enumerate(zip(ctx.registry.dataloaders, positions["dataloaders"])):
        check_loader_state(loader, position, f"{where} ({data_file}, dataloader {i})", resized=not same_size)
    if rank is not None:
        try:
            check_rng_state(rank["rng"], f"{where} ({rank_file})")
        except RuntimeError as e:
            raise ValueError(str(e)) from e
    seed = positions.get("seed")
    derived = None if rank is not None else (int(seed) if isinstance(seed, int) else 0) + state.process_index
    return {
        "dataloaders": positions["dataloaders"],
        "rng": rank["rng"] if rank is not None else None,
        "derived_seed": None if derived is None else derived % (_MAX_SEED + 1),
    }


def _loader(directory: str, where: str, weights_only: bool) -> Any:
    """``load(file name)``: a torch file of the checkpoint, through torch's allow-list with
    ``weights_only`` (a file asking for more is an ``UnsafeCheckpoint`` naming it and what it
    asked for); any other failure is a ValueError naming the file."""
    hint = (
        " (objects other than tensors/containers need load_state(..., weights_only=False) "
        "for a trusted checkpoint)" if weights_only else ""
    )

    def load(file_name: str) -> Any:
        try:
            return unpickle.torch_load(os.path.join(directory, file_name), f"{where}: cannot read {file_name!r}", weights_only, hint)
        except UnsafeCheckpoint:
            raise
        except Exception as e:
            raise ValueError(f"{where}: cannot read {file_name!r}: {type(e).__name__}: {e}{hint}") from e

    return load


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


def restore_custom_objects(objects: list[Any], states: list[Any], directory: str) -> None:
    """``load_state_dict`` each registered object; if one raises, put back those done before it."""
    done: list[tuple[Any, Any]] = []
    for i, (obj, sd) in enumerate(zip(objects, states)):
        before = copy.deepcopy(obj.state_dict())
        try:
            obj.load_state_dict(sd)
        except Exception as e:
            for restored, old in reversed(done):
                restored.load_state_dict(old)
            raise ValueError(
                f"load_state: registered object {i} ({type(obj).__name__}) refused its state from {directory!r} "
                f"({type(e).__name__}: {e}); nothing was restored"
            ) from e
        done.append((obj, before))


LAYOUT = FullLayout()
