"""The Accelerator's option dataclasses, with Accelerate's names and fields.

``ProjectConfiguration`` (where checkpoints and logs go), ``GradientAccumulationPlugin``
(how gradients accumulate) and ``DataLoaderConfiguration`` (how ``prepare`` shards
dataloaders). Each is validated when it is
built, so a bad value fails on the user's own line with the field, the value and what is
allowed. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _validate as v
from .handlers import KwargsHandler

__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration"]


def _optional_path(owner: str, field: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike) or None, got {value!r}")
    return os.fspath(value)


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs, and how checkpoints are named.

    - ``project_dir``: the run's folder; checkpoints named automatically go to
      ``project_dir/checkpoints/checkpoint_N``.
    - ``logging_dir``: where trackers that write files (TensorBoard) log; defaults to ``project_dir``.
    - ``automatic_checkpoint_naming``: ``save_state()`` always names the checkpoint itself
      (an ``output_dir`` passed to it is ignored, with a warning), as in Accelerate. Without it,
      ``save_state()`` with no ``output_dir`` names it too (hasten's default).
    - ``total_limit``: keep only the newest N automatically named checkpoints.
    - ``iteration``: the N of the next automatically named checkpoint (at least one more than
      the largest existing N, so nothing is overwritten); counts up after each save.
    - ``save_on_each_node``: ``save()`` and ``save_model()`` write on the local main process
      of every machine (for machines without a shared filesystem).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        owner = "ProjectConfiguration"
        self.project_dir = _optional_path(owner, "project_dir", self.project_dir)
        self.logging_dir = _optional_path(owner, "logging_dir", self.logging_dir)
        v.check_bool(owner, "automatic_checkpoint_naming", self.automatic_checkpoint_naming)
        if self.total_limit is not None:
            v.check_number(owner, "total_limit", self.total_limit, integer=True, ge=1)
        v.check_number(owner, "iteration", self.iteration, integer=True, ge=0)
        v.check_bool(owner, "save_on_each_node", self.save_on_each_node)
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when no logging directory was given."""
        self.project_dir = _optional_path("ProjectConfiguration", "project_dir", project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate: ``Accelerator(gradient_accumulation_plugin=...)``.

    - ``num_steps``: micro-steps (``accumulate()`` blocks) per optimizer step; None means the
      launcher's ``--gradient_accumulation_steps``, else 1.
    - ``adjust_scheduler``: accepted and checked for Accelerate's sake; the learning rate
      follows real optimizer steps either way, as it does in Accelerate (whose flag only
      bumps the scheduler's internal step counter), so a schedule sized in optimizer steps
      ends on time.
    - ``sync_with_dataloader``: the last batch of a prepared dataloader ends the cycle (a
      shorter last cycle); False lets a cycle run on into the next epoch.
    - ``sync_each_batch``: all-reduce the gradients of every micro-step (no ``no_sync``): less
      memory under DDP, more communication. The optimizer still steps every ``num_steps``.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        owner = "GradientAccumulationPlugin"
        if self.num_steps is not None:
            v.check_number(owner, "num_steps", self.num_steps, integer=True, ge=1)
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            v.check_bool(owner, name, getattr(self, name))


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders: ``Accelerator(dataloader_config=...)``.

    - ``split_batches``: cut each batch of the loader into one part per process (the batch
      size must divide by the number of processes); False: each process gets whole batches.
    - ``dispatch_batches``: None or False (each process loads its own share). True (the main
      process loads and sends the batches) is not supported.
    - ``even_batches``: complete the last global batch with samples from the start so every
      process gets as many batches of the same size.
    - ``use_seedable_sampler``: shuffle epoch ``e`` from a generator seeded with
      ``torch.initial_seed() + e`` (Accelerate's seedable sampler). False: shuffle as Accelerate
      does by default (one process: as plain PyTorch; several: one generator seeded at
      ``prepare`` from torch's global generator). Either way ``set_seed`` fixes the order, every
      process agrees on it, and a mid-epoch resume continues it exactly.
    - ``data_seed``: the seed of the seedable sampler instead of ``torch.initial_seed()``; in
      hasten it implies ``use_seedable_sampler`` (Accelerate ignores it without).
    - ``non_blocking``: hasten copies batches to the device with ``non_blocking`` whenever the
      loader pins memory (``pin_memory=True``), the only case where a copy can overlap; so
      True and False behave alike.
    - ``use_stateful_dataloader``: not supported (torchdata); prepared loaders already save and
      restore their position with ``save_state``/``load_state``.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        owner = "DataLoaderConfiguration"
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking", "use_stateful_dataloader"):
            v.check_bool(owner, name, getattr(self, name))
        v.check_optional_bool(owner, "dispatch_batches", self.dispatch_batches)
        if self.dispatch_batches:
            raise ValueError(
                "DataLoaderConfiguration.dispatch_batches=True is not supported by hasten (the main process would load "
                "every batch and send each process its part); use None or False: each process loads its own share"
            )
        if self.use_stateful_dataloader:
            raise ValueError(
                "DataLoaderConfiguration.use_stateful_dataloader=True is not supported by hasten (torchdata's "
                "StatefulDataLoader); use False: prepared dataloaders already resume mid-epoch through save_state/load_state"
            )
        if self.data_seed is not None:
            v.check_number(owner, "data_seed", self.data_seed, integer=True, ge=0, le=2**63 - 1)


def _env_text(*names: str) -> str | None:
    """The first of these environment variables that is set (hasten's, then Accelerate's)."""
    for name in names:
        raw = os.environ.get(name)
        if raw not in (None, ""):
            return raw
    return None


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How ``prepare`` compiles models with ``torch.compile`` (Accelerate's fields and defaults).

    - ``backend``: a torch.compile backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...; a
      ``DynamoBackend`` member or any case) or ``"no"``; None reads ``HASTEN_DYNAMO_BACKEND``
      (then ``ACCELERATE_DYNAMO_BACKEND``), else ``"no"``. Kept as the lower-case name torch uses.
    - ``mode``: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
      ``"max-autotune-no-cudagraphs"``; None reads ``HASTEN_DYNAMO_MODE``, else ``"default"``.
    - ``fullgraph``, ``dynamic``: torch.compile's; None reads ``HASTEN_DYNAMO_USE_FULLGRAPH`` /
      ``HASTEN_DYNAMO_USE_DYNAMIC`` (fullgraph then defaults to False, dynamic stays None: torch
      decides, marking a shape dynamic after it changed once).
    - ``options``: a dict for the backend (not together with a ``mode`` other than "default").
    - ``disable``: compile nothing (for tests).
    - ``use_regional_compilation``: compile each repeated block (children of one class that occur
      more than once, e.g. a transformer's layers) instead of the whole model: the blocks share
      one compiled graph, so the cold start is shorter. None reads
      ``HASTEN_DYNAMO_USE_REGIONAL_COMPILATION``, else False.

    An unknown backend or mode is a ValueError here, listing the choices.
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        from .choices import (
            DYNAMO_MODES,
            ENV_DYNAMO_BACKEND,
            ENV_DYNAMO_MODE,
            ENV_DYNAMO_USE_DYNAMIC,
            ENV_DYNAMO_USE_FULLGRAPH,
            ENV_DYNAMO_USE_REGIONAL_COMPILATION,
        )

        owner = "TorchDynamoPlugin"
        if self.backend is None:
            self.backend = _env_text(ENV_DYNAMO_BACKEND, "ACCELERATE_DYNAMO_BACKEND") or "no"
        if not isinstance(self.backend, str):
            raise TypeError(f"{owner}.backend must be a backend name (str or DynamoBackend), got {self.backend!r}")
        self.backend = str(getattr(self.backend, "value", self.backend)).strip().lower()
        if self.backend != "no":
            known = available_backends()
            if self.backend not in known:
                raise ValueError(
                    f"{owner}.backend must be 'no' or a torch.compile backend registered here, got {self.backend!r}; "
                    f"choices: {', '.join(repr(b) for b in ['no', *known])}"
                )
        if self.mode is None:
            self.mode = _env_text(ENV_DYNAMO_MODE, "ACCELERATE_DYNAMO_MODE") or "default"
        self.mode = v.check_choice(owner, "mode", self.mode, DYNAMO_MODES)
        for name, env in (("fullgraph", ENV_DYNAMO_USE_FULLGRAPH),
                          ("use_regional_compilation", ENV_DYNAMO_USE_REGIONAL_COMPILATION),
                          ("dynamic", ENV_DYNAMO_USE_DYNAMIC)):
            if getattr(self, name) is None:
                raw = _env_text(env, env.replace("HASTEN_", "ACCELERATE_"))
                if raw is not None:
                    setattr(self, name, v.parse_bool_text(f"environment variable {env}", raw))
                elif name != "dynamic":
                    setattr(self, name, False)
        v.check_bool(owner, "fullgraph", self.fullgraph)
        v.check_bool(owner, "use_regional_compilation", self.use_regional_compilation)
        v.check_optional_bool(owner, "dynamic", self.dynamic)
        v.check_bool(owner, "disable", self.disable)
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"{owner}.options must be a dict of backend options or None, got {self.options!r}")
        if self.options and self.mode != "default":
            raise ValueError(
                f"{owner} got mode={self.mode!r} and options={self.options!r}; torch.compile takes one of them "
                "(leave mode at 'default' to pass options)"
            )

    @property
    def enabled(self) -> bool:
        return self.backend != "no" and not self.disable

    def to_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` arguments (without ``use_regional_compilation``, which is hasten's)."""
        kwargs = {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.options:
            kwargs["options"] = self.options
            del kwargs["mode"]
        return kwargs


def available_backends() -> list[str]:
    """The torch.compile backends registered in this process (debug ones such as aot_eager included)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))
