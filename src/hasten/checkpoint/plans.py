"""What a layout plans: a ``SavePlan`` (what one process writes) and a ``Restore`` (what a load applies).

A layout only plans: ``Layout.plan_save`` takes the state dicts and says which files hold what
(``FileWrite``: a torch file, a weights file or JSON; ``ShardedWrite``: a
``torch.distributed.checkpoint`` folder every process writes its shards of) and what the
manifest records of the models (``ManifestFields``). An executor (``executor.Executor`` now,
``background.BackgroundExecutor`` from a host copy in the writer thread) writes the plan, hashing
every file as it writes it (a sharded file item by item: the manifest's "parts"), and the commit
step (``commit.Transaction``) writes the manifest and renames the folder into place.

``Layout.read`` reads and checks a checkpoint and returns a ``Restore``: the state of each
object, which ``restore.apply`` puts into them once every process read everything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class FileWrite:
    """One file of a checkpoint: ``obj`` written as ``kind`` to ``name`` (relative to the folder).

    ``kind``: "torch" (``torch.save``), "weights" (a model's state dict: safetensors with
    ``safe``, else ``torch.save``) or "json". ``large``: an asynchronous save copies ``obj`` to
    host memory in the writer thread and writes it there (else it is written before
    ``save_state`` returns, from the object itself)."""

    name: str
    obj: Any
    kind: Literal["torch", "weights", "json"] = "torch"
    safe: bool = False
    large: bool = False


@dataclass(frozen=True)
class ShardedWrite:
    """A ``torch.distributed.checkpoint`` folder: every process writes its shards of ``state_dict``
    (DTensors keep their sharding), all together (a collective), in plan order."""

    folder: str
    state_dict: Any


@dataclass(frozen=True)
class ManifestFields:
    """What a hasten layout adds to the manifest (the main process's; see ``manifest.py``)."""

    world_size: int
    mixed_precision: str
    scaler: bool
    step: int
    counts: dict[str, int]
    models: list[dict[str, Any]]  # per model: {"file": name} or {"dir": folder}, and its "tensors" table
    #: the names of the files (``layouts.names``): "accelerate" or "hasten"
    file_names: str = "hasten"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SavePlan:
    """What one process writes into the temporary folder: first the sharded folders (every process,
    together), then its files; ``manifest``: the layout's manifest fields (main process only)."""

    sharded: list[ShardedWrite] = field(default_factory=list)
    files: list[FileWrite] = field(default_factory=list)
    manifest: ManifestFields | None = None


@dataclass(frozen=True)
class Written:
    """One process's report of what it wrote: ``files`` (name -> size and checksum, as written)
    and its plan's manifest fields (main process only)."""

    files: dict[str, dict[str, Any]]
    manifest: ManifestFields | None


@dataclass(frozen=True)
class LoadOptions:
    """``load_state``'s reading options (checked where they entered)."""

    weights_only: bool = True
    verify_checksums: bool = True
    strict_world_size: bool = False


@dataclass
class Restore:
    """Everything a load puts back, read and checked; nothing of it applied yet (``restore.apply``).

    ``micro_step`` and each ``optimizer_counters`` entry (``real_steps``, ``sync_steps``) are
    as the checkpoint holds them (converted as they are applied). ``optimizer_counters``,
    ``dataloaders`` (positions) and ``rng`` are None where the checkpoint has none to restore
    (Accelerate's: the objects keep theirs); ``derived_seed``: with no RNG states of this
    process's rank (a larger run than saved), the seed its generators start from. ``warning``:
    said once everything is restored."""

    where: str  # the checkpoint, in the messages' words ("the checkpoint '/x'")
    models: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)
    scaler: dict[str, Any] | None = None
    micro_step: Any = 0
    optimizer_counters: list[dict[str, Any]] | None = None
    dataloaders: list[Any] | None = None
    rng: dict[str, Any] | None = None
    derived_seed: int | None = None
    warning: str | None = None
    fault_tolerance: dict[str, Any] | None = None  # FaultTolerance.state_dict(), where saved with it
    #: what ``read`` matched the optimizers against: each one's parameter names per group (the
    #: whole model's, from ``Strategy.optimizer_names``)
    optimizer_names: list[list[list[str]]] = field(default_factory=list)
