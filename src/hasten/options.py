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


class _NotGiven:
    """The default of an Accelerator argument the caller did not pass (its value is ``value``)."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


SPLIT_BATCHES_DEFAULT: Any = _NotGiven(False)
EVEN_BATCHES_DEFAULT: Any = _NotGiven(True)


def dataloader_configuration(split_batches: Any, even_batches: Any, config: Any) -> DataLoaderConfiguration:
    """The Accelerator's DataLoaderConfiguration from ``dataloader_config`` or the direct arguments (not both)."""
    given = {k: x for k, x in (("split_batches", split_batches), ("even_batches", even_batches)) if not isinstance(x, _NotGiven)}
    for name, value in given.items():
        v.check_bool("Accelerator", name, value)
    if config is None:
        return DataLoaderConfiguration(**{k: x.value if isinstance(x, _NotGiven) else x for k, x in
                                          (("split_batches", split_batches), ("even_batches", even_batches))})
    if not isinstance(config, DataLoaderConfiguration):
        raise TypeError(f"Accelerator.dataloader_config must be a DataLoaderConfiguration or None, got {config!r}")
    if given:
        args = ", ".join(f"{k}={x!r}" for k, x in given.items())
        raise ValueError(
            f"Accelerator got dataloader_config and {args}; set {', '.join(given)} in the DataLoaderConfiguration only"
        )
    return config


def accumulation_plugin(gradient_accumulation_steps: int | None, plugin: Any) -> GradientAccumulationPlugin | None:
    """The plugin given to the Accelerator (checked against ``gradient_accumulation_steps``), or None."""
    if plugin is None:
        return None
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(f"Accelerator.gradient_accumulation_plugin must be a GradientAccumulationPlugin or None, got {plugin!r}")
    if gradient_accumulation_steps not in (None, 1):
        raise ValueError(
            f"Accelerator got both gradient_accumulation_steps={gradient_accumulation_steps!r} and "
            f"gradient_accumulation_plugin={plugin!r}; pass one (the plugin's num_steps)"
        )
    return plugin


def project_configuration(project_dir: Any, project_config: Any) -> ProjectConfiguration:
    """The Accelerator's ProjectConfiguration from its ``project_dir`` and ``project_config`` arguments."""
    if project_config is None:
        if project_dir is not None and not isinstance(project_dir, (str, os.PathLike)):
            raise TypeError(f"Accelerator.project_dir must be a path (str or os.PathLike) or None, got {project_dir!r}")
        return ProjectConfiguration(project_dir=project_dir)
    if not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"Accelerator.project_config must be a ProjectConfiguration or None, got {project_config!r}")
    if project_dir is not None:
        given = _optional_path("Accelerator", "project_dir", project_dir)
        if project_config.project_dir is None:
            project_config.set_directories(given)
        elif os.path.abspath(given) != os.path.abspath(project_config.project_dir):
            raise ValueError(
                f"Accelerator(project_dir={given!r}) conflicts with ProjectConfiguration(project_dir="
                f"{project_config.project_dir!r}); give the project directory once"
            )
    return project_config


# Accelerator arguments of Accelerate's that hasten has no counterpart for: what each is for.
_ACCELERATE_ONLY = {
    "deepspeed_plugin": "DeepSpeed",
    "deepspeed_plugins": "DeepSpeed",
    "fsdp_plugin": "FSDP (fully sharded data parallel)",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism",
    "parallelism_config": "N-D parallelism",
    "dynamo_backend": "torch.compile: call torch.compile(model) yourself, before or after prepare",
    "dynamo_plugin": "torch.compile: call torch.compile(model) yourself, before or after prepare",
    "rng_types": (
        "synchronising random generators at each epoch: hasten's shuffling uses one seeded sampler on "
        "every process (set_seed, or DataLoaderConfiguration(data_seed=...)), so the order already agrees "
        "(Accelerate's default, rng_types=['generator'], is what hasten does)"
    ),
}


def accelerate_only(arguments: dict[str, Any]) -> dict[str, Any]:
    """The unexpected arguments left after Accelerate-only ones that ask for nothing (None, "no").

    One that asks for something is a clear error naming what hasten does not do.
    """
    left = {}
    for name, value in arguments.items():
        if name not in _ACCELERATE_ONLY:
            left[name] = value
        elif not (value is None or (name == "dynamo_backend" and str(value).lower() == "no")):
            raise TypeError(
                f"Accelerator({name}={value!r}) is Accelerate's argument for {_ACCELERATE_ONLY[name]}; hasten does "
                f"not support it (leave {name} out, or pass None). README, 'Coming from Accelerate', lists what is supported"
            )
    return left
