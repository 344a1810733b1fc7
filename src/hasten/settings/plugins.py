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

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings import locations
from hasten.settings.activation_checkpointing import AC_MODES, ActivationCheckpointingConfig
from hasten.settings.activation_checkpointing import as_config as as_ac_config
from hasten.settings.handlers import KwargsHandler

__all__ = [
    "DataLoaderConfiguration",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
]


def _optional_path(owner: str, field: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike) or None, got {v.shown(value)}")
    path = os.fspath(value)
    if not path:  # "" would mean the current folder to some callers and nothing to others
        raise ValueError(f"{owner}.{field} must be a non-empty path or None, got {value!r}")
    if isinstance(path, str):
        locations.check_typo(owner, field, path)  # "s3:/bucket/x": a typo of a URL, never a folder "s3:"
    if locations.is_url(path):  # a URL is never a local path: its fsspec protocol must be installed
        local = locations.local_path(path)
        if local is not None:
            return local
        locations.check_url(owner, field, path)
        locations.check_protocol(owner, field, path)
    return path


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and logs, and how checkpoints are named.

    - ``project_dir``: the run's folder; checkpoints named automatically go to
      ``project_dir/checkpoints/checkpoint_N``. A local path, or a URL of any installed fsspec
      protocol (``s3://bucket/run``, ``gs://``, ``az://``, ``memory://``); a URL whose protocol
      is not installed is refused here, naming the package (``pip install s3fs``).
    - ``logging_dir``: where trackers that write files (TensorBoard) log; defaults to ``project_dir``
      (a local one: with a URL ``project_dir``, give a local ``logging_dir``).
    - ``automatic_checkpoint_naming``: ``save_state()`` always names the checkpoint itself
      (an ``output_dir`` passed to it is ignored, with a warning), as in Accelerate. Without it,
      ``save_state()`` with no ``output_dir`` names it too (hasten's default).
    - ``total_limit``: keep only the newest N automatically named checkpoints.
    - ``iteration``: the N of the next automatically named checkpoint (at least one more than
      the largest existing N, so nothing is overwritten); counts up after each save.
    - ``save_on_each_node``: ``save()`` and ``save_model()`` write on the local main process
      of every machine (for machines without a shared filesystem).
    - ``async_save``: ``save_state()`` returns once it has taken the state; the parameters
      and optimizer state are copied to host memory in the background (the next optimizer
      step waits for that copy) and written there (``save_state(async_save=...)`` overrides it
      for one save; ``accelerator.wait_for_checkpoint()`` waits for it). Not in Accelerate.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        owner = "ProjectConfiguration"
        self.project_dir = _optional_path(owner, "project_dir", self.project_dir)
        self.logging_dir = _optional_path(owner, "logging_dir", self.logging_dir)
        v.check_bool(owner, "automatic_checkpoint_naming", self.automatic_checkpoint_naming)
        if self.total_limit is not None:
            v.check_number(owner, "total_limit", self.total_limit, integer=True, ge=1)
        v.check_number(owner, "iteration", self.iteration, integer=True, ge=0)
        v.check_bool(owner, "save_on_each_node", self.save_on_each_node)
        v.check_bool(owner, "async_save", self.async_save)
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when no logging directory was given."""
        self.project_dir = _optional_path("ProjectConfiguration", "project_dir", project_dir)
        if self.logging_dir is None and not locations.is_url(self.project_dir):
            self.logging_dir = self.project_dir  # (trackers write files: a URL project_dir is no logging_dir)


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
    - ``dispatch_batches``: True: the main process loads the batches and sends each process its
      part (``DataLoaderDispatcher``; README, *Training loop*, Data loading), for data only one process
      should read. False: each process loads its own share. None (the default), as in
      Accelerate: True for a loader over an ``IterableDataset`` whose batches are placed on the
      device, False otherwise.
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
        for name in (
            "split_batches",
            "even_batches",
            "use_seedable_sampler",
            "non_blocking",
            "use_stateful_dataloader",
        ):
            v.check_bool(owner, name, getattr(self, name))
        v.check_optional_bool(owner, "dispatch_batches", self.dispatch_batches)
        if self.use_stateful_dataloader:
            raise ValueError(
                "DataLoaderConfiguration.use_stateful_dataloader=True is not supported by hasten (torchdata's "
                "StatefulDataLoader); use False: prepared dataloaders already resume mid-epoch through "
                "save_state/load_state"
            )
        if self.data_seed is not None:
            v.check_number(owner, "data_seed", self.data_seed, integer=True, ge=0, le=2**63 - 1)


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

    An unknown backend or mode is a ValueError here, listing the choices; a ``DynamoBackend`` name
    that this torch has not registered (e.g. ``"aot_ts_nvfuser"``) is accepted here, as in Accelerate,
    and refused by the Accelerator that would compile with it.
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        from hasten.settings.choices import DYNAMO_MODES

        owner = "TorchDynamoPlugin"
        if self.backend is None:
            self.backend = env.env_text(*env.DYNAMO_FIELDS["backend"]) or "no"
        if not isinstance(self.backend, str):
            raise TypeError(f"{owner}.backend must be a backend name (str or DynamoBackend), got {self.backend!r}")
        self.backend = str(getattr(self.backend, "value", self.backend)).strip().lower()
        if self.backend != "no":
            # Accelerate's DynamoBackend names are accepted here even where this torch lacks the
            # backend (as Accelerate does); compiling with one that is missing fails at prepare.
            from hasten.settings.choices import DynamoBackend

            known = available_backends()
            if self.backend not in known and self.backend.upper() not in DynamoBackend.__members__:
                raise ValueError(
                    f"{owner}.backend must be 'no' or a torch.compile backend registered here, got {self.backend!r}; "
                    f"choices: {', '.join(repr(b) for b in ['no', *known])}"
                )
        if self.mode is None:
            self.mode = env.env_text(*env.DYNAMO_FIELDS["mode"]) or "default"
        self.mode = v.check_choice(owner, "mode", self.mode, DYNAMO_MODES)
        for name in ("fullgraph", "use_regional_compilation", "dynamic"):
            if getattr(self, name) is None:
                raw = env.env_text(*env.DYNAMO_FIELDS[name])
                if raw is not None:
                    setattr(self, name, v.parse_bool_text(f"environment variable {env.DYNAMO_FIELDS[name][0]}", raw))
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
        """The fields that differ from the defaults (as every handler's; the defaults as they are
        without ``*_DYNAMO_*`` environment variables), without ``use_regional_compilation``."""
        return {
            k: val
            for k, val in self.to_dict().items()
            if k != "use_regional_compilation" and _DYNAMO_DEFAULTS[k] != val
        }

    def compile_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` arguments (without ``use_regional_compilation``, which is hasten's)."""
        kwargs = {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.options:
            kwargs["options"] = self.options
            del kwargs["mode"]
        return kwargs


# TorchDynamoPlugin() where no HASTEN_DYNAMO_*/ACCELERATE_DYNAMO_* variable is set.
_DYNAMO_DEFAULTS: dict[str, Any] = {
    "backend": "no",
    "mode": "default",
    "fullgraph": False,
    "dynamic": None,
    "options": None,
    "disable": False,
    "use_regional_compilation": False,
}


def available_backends() -> list[str]:
    """The torch.compile backends registered in this process (debug ones such as aot_eager included,
    not torch's own test fixtures, ``*_TESTING_ONLY``, which fail on purpose)."""
    import torch._dynamo

    return sorted(b for b in torch._dynamo.list_backends(exclude_tags=()) if not b.endswith("_TESTING_ONLY"))


# ---------------------------------------------------------------------- FSDP2

FSDP_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
FSDP_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
#: FSDP1's sharding strategies, in the order of torch's ShardingStrategy (1..5, the numbers Accelerate's
#: files before 0.28 hold)
FSDP_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
#: The one mapping of FSDP1's strategies to FSDP2 (the plugin in code, the config file and the flags):
#: strategy -> reshard_after_forward. NO_SHARD is not here: it is DDP (every process keeps the whole
#: model); the HYBRID ones are HSDP (sharded within each machine, replicated across machines).
FSDP1_STRATEGY_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False}


def sharding_strategy_name(value: Any, numbers: bool = True) -> str | None:
    """``value`` as one of FSDP_SHARDING_STRATEGIES (any case, ``"ShardingStrategy.X"``, torch's
    ``ShardingStrategy`` enum, ``_HYBRID_SHARD_ZERO2``, and with ``numbers`` torch's 1..5), else None."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, (str, int)) and isinstance(getattr(value, "name", None), str):
        value = value.name  # torch.distributed.fsdp.ShardingStrategy.X
    text = str(value).strip().upper().rsplit(".", 1)[-1].lstrip("_") if isinstance(value, (str, int)) else ""
    if text.isdigit():
        number = int(text)
        return FSDP_SHARDING_STRATEGIES[number - 1] if numbers and 1 <= number <= 5 else None
    return text if text in FSDP_SHARDING_STRATEGIES else None


#: FSDP1 fields of Accelerate's plugin -> what FSDP2 (and so hasten) has instead
FSDP1_ONLY = {
    "backward_prefetch": "nothing: FSDP2 always prefetches the next block's all-gather in backward",
    "forward_prefetch": "nothing: FSDP2 overlaps the all-gathers in forward by itself",
    "use_orig_params": "nothing: FSDP2 always keeps the original parameters (as DTensors)",
    "sync_module_states": (
        "nothing: hasten always starts every process from the main process's weights "
        "(cpu_ram_efficient_loading=True lets the other processes build the model on the meta device)"
    ),
    "limit_all_gathers": "nothing: FSDP2 limits in-flight all-gathers by itself",
}
_FSDP_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
_MP_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _env_bool(name: str, raw: str) -> bool:
    return v.parse_bool_text(f"environment variable {name}", raw)


def use_fsdp_from_env() -> bool:
    """Whether the launcher asked for FSDP (HASTEN_USE_FSDP or ACCELERATE_USE_FSDP is true)."""
    return any(env.env_flag(n) for n in env.USE_FSDP)


def _dtype_name(owner: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).replace("torch.", "") if not isinstance(value, str) else value.lower()
    if text not in _FSDP_DTYPES:
        raise ValueError(
            f"{owner}.mixed_precision_policy[{key!r}] must be a torch dtype or one of "
            f"{', '.join(map(repr, _FSDP_DTYPES))}, got {value!r}"
        )
    return _FSDP_DTYPES[text]


@dataclass
class FullyShardedDataParallelPlugin:
    """Sharded data parallelism with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``):
    ``Accelerator(fsdp_plugin=...)``, Accelerate's name and FSDP2 fields.

    Each field left as None takes Accelerate's environment variable (``FSDP_VERSION``,
    ``FSDP_RESHARD_AFTER_FORWARD``, ``FSDP_OFFLOAD_PARAMS``, ``FSDP_AUTO_WRAP_POLICY``,
    ``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``FSDP_MIN_NUM_PARAMS``, ``FSDP_STATE_DICT_TYPE``,
    ``FSDP_ACTIVATION_CHECKPOINTING``, ``FSDP_CPU_RAM_EFFICIENT_LOADING``, ``FSDP_IGNORED_MODULES``), else the
    default.

    - ``fsdp_version``: 2 (hasten implements FSDP2 only).
    - ``reshard_after_forward``: free the gathered parameters after forward (True, ZeRO-3), keep
      them until backward (False, ZeRO-2), or reshard to groups of this many processes (an int).
    - ``cpu_offload``: keep the sharded parameters, gradients and optimizer step on the CPU
      (True, or a ``torch.distributed.fsdp.CPUOffloadPolicy``).
    - ``mixed_precision_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of its
      fields (dtypes as torch dtypes or "bf16"/"fp16"/"fp32"), a dtype name ("bf16": parameters
      gathered and gradients reduced in bf16, as Accelerate reads the string), or None: derived from
      ``Accelerator(mixed_precision=...)`` (parameters gathered in bf16/fp16, gradients reduced
      in fp32). The sharded master weights stay in their own dtype (fp32).
    - ``auto_wrap_policy``: which submodules are sharded as units of their own (one all-gather
      each): "transformer_based_wrap" (instances of ``transformer_cls_names_to_wrap``),
      "size_based_wrap" (submodules with at least ``min_num_params`` parameters of their own
      subtree, innermost first), "no_wrap" (the root only), or a callable ``policy(module) ->
      bool``. None: "transformer_based_wrap" when class names are given, else "no_wrap".
    - ``state_dict_type``: what ``save_state`` writes: "SHARDED_STATE_DICT" (each process writes
      its shards with ``torch.distributed.checkpoint``; loadable at another number of
      processes) or "FULL_STATE_DICT" (the full weights gathered into one safetensors file).
    - ``state_dict_config``, ``optim_state_dict_config``: None (Accelerate's default: derived from
      ``state_dict_type``), or torch's config of the same kind as ``state_dict_type``. A full one
      (``FullStateDictConfig``, ``FullOptimStateDictConfig``) says where the model's (optimizer's)
      full state dict is gathered by ``get_state_dict``, ``save_model`` and the "FULL_STATE_DICT"
      checkpoint: ``rank0_only`` on the main process only (the others get an empty dict) or on
      every process, ``offload_to_cpu`` in CPU memory or on the device (None: both True). With one
      process nothing is gathered: the state dict is the model's own. A sharded one is accepted
      with either ``offload_to_cpu``: ``torch.distributed.checkpoint`` writes the same files. A full
      config given without ``state_dict_type`` (nor ``FSDP_STATE_DICT_TYPE``) makes it
      "FULL_STATE_DICT"; a config of the other kind than ``state_dict_type`` is refused.
    - ``activation_checkpointing``: recompute each wrapped block's activations in backward: True or
      ``"full"`` (each block keeps only its inputs), ``"selective"`` (the outputs of matrix products,
      attention and collectives kept, the rest recomputed), or an ``ActivationCheckpointingConfig``
      (``hasten.settings.activation_checkpointing``: every other matmul, one block in n, or
      ``torch.compile``'s memory budget). ``FSDP_ACTIVATION_CHECKPOINTING`` takes true/false,
      ``full`` or ``selective``.
    - ``activation_checkpointing_offload``: with ``activation_checkpointing``, keep the inputs each
      checkpointed block saves for its recomputation in CPU memory (pinned on a GPU) until
      backward (``torch.autograd.graph.save_on_cpu``); the gradients are those of plain
      activation checkpointing.
    - ``cpu_ram_efficient_loading``: only the main process loads real weights (``hasten launch``
      exports what transformers' ``from_pretrained`` reads for that); the others build the model
      on the meta device and receive their shards. Any process may build on meta without it.
    - ``ignored_modules``: modules (or a regular expression matched against module names)
      whose parameters are not sharded (each process keeps and updates its own copy).
    - ``param_init_fn``: for a model built on the meta device on every process,
      ``param_init_fn(module)`` is called once for each module (parents first) with that
      module's own parameters standing in full on the CPU; each process keeps its slices. None:
      each module's ``reset_parameters()``. (FSDP1's field, given its FSDP2 meaning.)

    - ``sharding_strategy``: FSDP1's strategy ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
      "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"/"_HYBRID_SHARD_ZERO2", torch's ``ShardingStrategy`` or
      its number 1-5), run with FSDP2 as a config file's is: FULL_SHARD is
      ``reshard_after_forward=True``, SHARD_GRAD_OP ``False``; HYBRID_SHARD (ZERO2) the same,
      HSDP on several machines (replicated across machines, sharded within each); NO_SHARD is DDP.

    Accelerate's other FSDP1 fields (``backward_prefetch``, ...) are refused with their FSDP2
    equivalent.
    """

    fsdp_version: int | None = None
    reshard_after_forward: bool | int | None = None
    cpu_offload: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    state_dict_type: str | None = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    activation_checkpointing: bool | str | ActivationCheckpointingConfig | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    ignored_modules: Any = None
    param_init_fn: Any = None
    # FSDP1's strategy, mapped to FSDP2 as a config file's is (FSDP1_STRATEGY_RESHARD)
    sharding_strategy: Any = None
    # FSDP1 only: refused with their FSDP2 equivalent
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    use_orig_params: Any = None
    sync_module_states: Any = None
    limit_all_gathers: Any = None

    def __post_init__(self) -> None:
        owner = "FullyShardedDataParallelPlugin"
        for name, equivalent in FSDP1_ONLY.items():
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{owner}.{name}={getattr(self, name)!r} is an FSDP1 field; hasten implements FSDP2, "
                    f"whose equivalent is: {equivalent}. Leave {name} out"
                )
        self._map_sharding_strategy(owner)
        self._imply_state_dict_type()
        self._from_env()
        if isinstance(self.fsdp_version, bool) or self.fsdp_version not in (1, 2):
            raise ValueError(f"{owner}.fsdp_version must be 2, got {self.fsdp_version!r}")
        if self.fsdp_version == 1:
            raise ValueError(
                f"{owner}.fsdp_version=1: hasten implements FSDP2 only (torch.distributed.fsdp.fully_shard). "
                "The FSDP1 fields map as: sharding_strategy FULL_SHARD/SHARD_GRAD_OP -> reshard_after_forward "
                "True/False; cpu_offload -> cpu_offload; mixed_precision_policy -> mixed_precision_policy "
                "(a MixedPrecisionPolicy); auto_wrap_policy, transformer_cls_names_to_wrap, min_num_params, "
                "state_dict_type, activation_checkpointing -> the same; backward_prefetch, forward_prefetch, "
                "use_orig_params, sync_module_states, limit_all_gathers -> not needed. Use fsdp_version=2"
            )
        if not isinstance(self.reshard_after_forward, (bool, int)) or (
            not isinstance(self.reshard_after_forward, bool) and self.reshard_after_forward < 1
        ):
            raise ValueError(
                f"{owner}.reshard_after_forward must be True, False or an integer >= 1 (the size of the "
                f"groups to reshard to), got {self.reshard_after_forward!r}"
            )
        if not isinstance(self.cpu_offload, bool):
            from torch.distributed.fsdp import CPUOffloadPolicy

            if not isinstance(self.cpu_offload, CPUOffloadPolicy):
                raise TypeError(
                    f"{owner}.cpu_offload must be True, False or a torch.distributed.fsdp.CPUOffloadPolicy, "
                    f"got {self.cpu_offload!r}"
                )
        self._check_mixed_precision(owner)
        self._check_wrapping(owner)
        state_dict_type = self.state_dict_type
        if isinstance(state_dict_type, str) and "." in state_dict_type:  # StateDictType.FULL_STATE_DICT
            state_dict_type = state_dict_type.rsplit(".", 1)[1]
        if isinstance(state_dict_type, str):
            state_dict_type = state_dict_type.upper()
        elif hasattr(state_dict_type, "name"):  # torch's StateDictType enum
            state_dict_type = state_dict_type.name
        if state_dict_type == "LOCAL_STATE_DICT":
            raise ValueError(
                f"{owner}.state_dict_type='LOCAL_STATE_DICT' is FSDP1's; FSDP2 has "
                f"{', '.join(map(repr, FSDP_STATE_DICT_TYPES))}"
            )
        self.state_dict_type = v.check_choice(owner, "state_dict_type", state_dict_type, FSDP_STATE_DICT_TYPES)
        self._check_state_dict_configs(owner)
        ac = as_ac_config(owner, "activation_checkpointing", self.activation_checkpointing)
        v.check_bool(owner, "activation_checkpointing_offload", self.activation_checkpointing_offload)
        if self.activation_checkpointing_offload and (ac is None or not ac.wraps):
            raise ValueError(
                f"{owner}.activation_checkpointing_offload=True offloads the inputs that activation checkpointing "
                "keeps for its recomputation: set activation_checkpointing=True too (or leave the offload out)"
            )
        v.check_bool(owner, "cpu_ram_efficient_loading", self.cpu_ram_efficient_loading)
        v.check_callable(owner, "param_init_fn", self.param_init_fn)
        self._check_ignored_modules(owner)

    def _map_sharding_strategy(self, owner: str) -> None:
        """FSDP1's ``sharding_strategy`` as FSDP2 runs it, by the mapping the config file uses:
        FULL_SHARD/SHARD_GRAD_OP set ``reshard_after_forward`` True/False, the HYBRID ones the same
        and HSDP across machines (``hybrid_dims``), NO_SHARD DDP (the Accelerator drops the plugin)."""
        given = self.sharding_strategy
        if given is None:
            return
        name = sharding_strategy_name(given)
        if name is None:
            raise ValueError(
                f"{owner}.sharding_strategy must be one of {', '.join(map(repr, FSDP_SHARDING_STRATEGIES))}, "
                f"torch's ShardingStrategy or its number (1 to 5), got {v.shown(given)}"
            )
        self.sharding_strategy = name
        reshard = FSDP1_STRATEGY_RESHARD.get(name)
        if reshard is None:  # NO_SHARD
            return
        if self.reshard_after_forward is not None and self.reshard_after_forward != reshard:
            raise ValueError(
                f"{owner}.sharding_strategy={name!r} means reshard_after_forward={reshard}, but "
                f"reshard_after_forward={self.reshard_after_forward!r} is given: give one of them"
            )
        self.reshard_after_forward = reshard

    def hybrid_dims(self, world_size: int, local_world_size: int) -> tuple[int, int] | None:
        """``(dp_replicate_size, dp_shard_size)`` for a HYBRID strategy on several machines (one
        replica per machine, sharded over its processes), else None (sharded over every process)."""
        if self.sharding_strategy not in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            return None
        if local_world_size < 1 or world_size <= local_world_size or world_size % local_world_size:
            return None
        return world_size // local_world_size, local_world_size

    def _check_ignored_modules(self, owner: str) -> None:
        if self.ignored_modules is not None and not isinstance(self.ignored_modules, str):
            import torch

            given = self.ignored_modules
            try:
                modules = [given] if isinstance(given, torch.nn.Module) else list(given)
            except TypeError:
                modules = [given]
            if not all(isinstance(m, torch.nn.Module) for m in modules):
                raise TypeError(
                    f"{owner}.ignored_modules must be a list of torch.nn.Module or a regular expression (str) "
                    f"matched against module names, got {self.ignored_modules!r}"
                )
            self.ignored_modules = modules
        elif isinstance(self.ignored_modules, str):
            import re

            try:
                re.compile(self.ignored_modules)
            except re.error as e:
                raise ValueError(
                    f"{owner}.ignored_modules={self.ignored_modules!r} is not a regular expression: {e}"
                ) from None

    def check_num_processes(self, num_processes: int) -> None:
        """Refuse a ``reshard_after_forward`` group size that does not divide the processes that
        shard (every process: hasten's mesh is 1-D), as ``fully_shard`` would on every process."""
        size = self.reshard_after_forward
        if isinstance(size, bool) or num_processes <= 1 or num_processes % size == 0:
            return
        sizes = [d for d in range(2, num_processes + 1) if num_processes % d == 0]
        raise ValueError(
            f"FullyShardedDataParallelPlugin.reshard_after_forward={size} must divide the number of processes "
            f"that shard the model ({num_processes}): a group size of {' or '.join(map(str, sizes))}, "
            "or True (reshard to all of them) or False (keep the gathered parameters until backward)"
        )

    def _from_env(self) -> None:
        """Fields left as None from Accelerate's FSDP_* variables, else their defaults."""
        parsers: dict[str, Any] = {
            "fsdp_version": lambda n, s: _env_int(n, s),
            "reshard_after_forward": _env_reshard,
            "cpu_offload": _env_bool,
            "auto_wrap_policy": lambda n, s: s,
            "transformer_cls_names_to_wrap": lambda n, s: s,
            "min_num_params": lambda n, s: _env_int(n, s),
            "state_dict_type": lambda n, s: s,
            "activation_checkpointing": _env_checkpointing,
            "activation_checkpointing_offload": _env_bool,
            "cpu_ram_efficient_loading": _env_bool,
            "ignored_modules": lambda n, s: s.strip(),
        }
        defaults: dict[str, Any] = {
            "fsdp_version": 2,
            "reshard_after_forward": True,
            "cpu_offload": False,
            "state_dict_type": "SHARDED_STATE_DICT",
            "activation_checkpointing": False,
            "activation_checkpointing_offload": False,
            "cpu_ram_efficient_loading": False,
        }
        for name, variable in env.FSDP_FIELDS.items():
            if getattr(self, name) is not None:
                continue
            raw = env.get(variable) or ""
            if raw.strip():
                setattr(self, name, parsers[name](variable, raw))
            elif name in defaults:
                setattr(self, name, defaults[name])

    def _check_mixed_precision(self, owner: str) -> None:
        policy = self.mixed_precision_policy
        if policy is None:
            return
        if isinstance(policy, str):  # Accelerate's string: parameters and reductions in that dtype
            if policy.lower() not in _FSDP_DTYPES:
                raise ValueError(
                    f"{owner}.mixed_precision_policy must be a MixedPrecisionPolicy, a dict of its fields, one of "
                    f"{', '.join(map(repr, _FSDP_DTYPES))} or None, got {policy!r}"
                )
            name = _FSDP_DTYPES[policy.lower()]
            self.mixed_precision_policy = policy = {"param_dtype": name, "reduce_dtype": name}
        if isinstance(policy, dict):
            unknown = [k for k in policy if k not in _MP_KEYS]
            if unknown:
                raise ValueError(
                    f"{owner}.mixed_precision_policy has unknown keys {unknown}; allowed: {', '.join(_MP_KEYS)}"
                )
            for key in ("param_dtype", "reduce_dtype", "output_dtype"):
                _dtype_name(owner, key, policy.get(key))
            if "cast_forward_inputs" in policy:
                v.check_bool(owner, "mixed_precision_policy['cast_forward_inputs']", policy["cast_forward_inputs"])
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(
                f"{owner}.mixed_precision_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, a dict of "
                f"its fields or None, got {policy!r}"
            )

    def _check_state_dict_configs(self, owner: str) -> None:
        """``state_dict_config``/``optim_state_dict_config``: None, or torch's config of ``state_dict_type``'s
        kind (torch's ``FSDP.set_state_dict_type`` refuses one of the other kind; so does this, naming both)."""
        for field, full_name, sharded_name in (
            ("state_dict_config", "FullStateDictConfig", "ShardedStateDictConfig"),
            ("optim_state_dict_config", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"),
        ):
            config = getattr(self, field)
            if config is None:
                continue
            import torch.distributed.fsdp as fsdp

            full = self.state_dict_type == "FULL_STATE_DICT"
            wanted, other = (full_name, sharded_name) if full else (sharded_name, full_name)
            if isinstance(config, getattr(fsdp, wanted)):
                continue
            hint = ""
            if isinstance(config, getattr(fsdp, other)):  # the other kind: name both, and the type that takes it
                other_type = "SHARDED_STATE_DICT" if full else "FULL_STATE_DICT"
                hint = f", or state_dict_type={other_type!r} for a torch.distributed.fsdp.{other}"
            raise TypeError(
                f"{owner}.{field} must be None or a torch.distributed.fsdp.{wanted} (state_dict_type="
                f"{self.state_dict_type!r}){hint}, got {config!r}"
            )

    def _imply_state_dict_type(self) -> None:
        """A full config given without a ``state_dict_type`` (argument or ``FSDP_STATE_DICT_TYPE``) asks
        for full state dicts: "FULL_STATE_DICT" (Accelerate's default type for its default FSDP version)."""
        if self.state_dict_type is not None or (env.get(env.FSDP_FIELDS["state_dict_type"]) or "").strip():
            return
        config = self.state_dict_config if self.state_dict_config is not None else self.optim_state_dict_config
        if config is None:
            return
        import torch.distributed.fsdp as fsdp

        if isinstance(config, (fsdp.FullStateDictConfig, fsdp.FullOptimStateDictConfig)):
            self.state_dict_type = "FULL_STATE_DICT"

    def full_gather(self, field: str = "state_dict_config") -> tuple[bool, bool]:
        """Where a full state dict is gathered, as ``(offload_to_cpu, rank0_only)``: from a full
        ``state_dict_config`` (the model's) or ``optim_state_dict_config`` (the optimizer's), else
        Accelerate's default ``(True, True)``: on the main process only, in CPU memory."""
        config = getattr(self, field)
        if config is None or self.state_dict_type != "FULL_STATE_DICT":
            return True, True
        return bool(config.offload_to_cpu), bool(config.rank0_only)

    @property
    def activation_checkpointing_config(self) -> ActivationCheckpointingConfig | None:
        """``activation_checkpointing`` as a config (None: off)."""
        return as_ac_config("FullyShardedDataParallelPlugin", "activation_checkpointing", self.activation_checkpointing)

    def checkpoint_wrapper(self, pin_memory: bool) -> Any:
        """The wrapper ``apply_activation_checkpointing`` puts around each checkpointed block: torch's
        ``checkpoint_wrapper`` (with the selective policy where chosen), whose checkpoint runs under
        ``save_on_cpu`` with the offload."""
        config = self.activation_checkpointing_config or ActivationCheckpointingConfig()
        return config.wrapper(bool(self.activation_checkpointing_offload), pin_memory)

    def _check_wrapping(self, owner: str) -> None:
        names = self.transformer_cls_names_to_wrap
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        if names is not None:
            if not isinstance(names, (list, tuple, set)) or not all(isinstance(n, str) and n for n in names):
                raise TypeError(
                    f"{owner}.transformer_cls_names_to_wrap must be a list of class names (or one comma-separated "
                    f"str), got {self.transformer_cls_names_to_wrap!r}"
                )
            names = list(names)
        self.transformer_cls_names_to_wrap = names
        policy = self.auto_wrap_policy
        if policy is None:
            policy = "transformer_based_wrap" if names else "no_wrap"
        if not callable(policy):
            if not isinstance(policy, str):
                raise TypeError(
                    f"{owner}.auto_wrap_policy must be one of {', '.join(map(repr, FSDP_WRAP_POLICIES))} or a "
                    f"callable policy(module) -> bool, got {policy!r}"
                )
            policy = v.check_choice(owner, "auto_wrap_policy", policy.lower(), FSDP_WRAP_POLICIES)
        self.auto_wrap_policy = policy  # transformer_based_wrap without names: the model's _no_split_modules
        if self.min_num_params is not None:
            v.check_number(owner, "min_num_params", self.min_num_params, integer=True, ge=1)
        elif policy == "size_based_wrap":
            self.min_num_params = 100_000_000  # Accelerate's and torch's default

    def given_mixed_precision(self) -> Any:
        """``mixed_precision_policy`` as a ``MixedPrecisionPolicy``, or None where it is not given
        (the precision then derives one: ``Precision.fsdp_mixed_precision``)."""
        policy = self.mixed_precision_policy
        if policy is None:
            return None
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if isinstance(policy, MixedPrecisionPolicy):
            return policy
        kwargs = dict(policy)  # a dict of its fields (Accelerate's string became one in __post_init__)
        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            name = _dtype_name("FullyShardedDataParallelPlugin", key, kwargs.get(key))
            if name is not None:
                kwargs[key] = getattr(torch, name)
        return MixedPrecisionPolicy(**kwargs)

    def offload_policy(self, pin_memory: bool) -> Any:
        """``fully_shard``'s ``offload_policy``: ``cpu_offload`` as given, True as a
        ``CPUOffloadPolicy`` (pinned host memory only where there is an accelerator to copy to)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.cpu_offload is True:
            return CPUOffloadPolicy(pin_memory=pin_memory)
        if self.cpu_offload is False:
            return OffloadPolicy()
        return self.cpu_offload


def wrap_class_names(module: Any, given: tuple[str, ...] | list[str]) -> list[str]:
    """The block classes "transformer_based_wrap" shards as units: ``given``, else (as Accelerate) the
    classes of the model's ``_no_split_modules`` (a transformers model's) that it contains. Where
    neither names one, a ValueError names the setting to add (in the config file, at its line,
    where the policy came from one)."""
    if given:
        return list(given)
    present = {type(m).__name__ for m in module.modules()}
    no_split = getattr(module, "_no_split_modules", None) or []
    found = [n for n in no_split if isinstance(n, str) and n in present]
    if found:
        return found
    why = (
        f"lists {list(no_split)}, none of which it contains"
        if no_split
        else "has no _no_split_modules (a transformers model's list of its blocks)"
    )
    raise ValueError(
        f"FSDP's auto_wrap_policy 'transformer_based_wrap' shards each block named by transformer_cls_names_to_wrap, "
        f"else each of the model's _no_split_modules; none is named, and the model ({type(module).__name__}) {why}. "
        f"{_where_to_name_blocks()} one or more of its module classes: {', '.join(sorted(present))}"
    )


def _where_to_name_blocks() -> str:
    """Where to name the blocks: the config file's fsdp section (with its line) where the launcher read
    the policy from one, else the plugin's field."""
    path = env.get(env.HASTEN_CONFIG_FILE)
    if path and env.FSDP_FIELDS["auto_wrap_policy"] in (env.get(env.HASTEN_FROM_CONFIG_FILE) or "").split(","):
        line = _config_line(path, ("fsdp_auto_wrap_policy", "auto_wrap_policy"))
        at = f" (next to fsdp_auto_wrap_policy, line {line})" if line else ""
        return f"Add fsdp_transformer_layer_cls_to_wrap to the fsdp section of {path}{at}, naming"
    return "Give FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[...]) (or FSDP_TRANSFORMER_CLS_TO_WRAP)"


def _config_line(path: str, keys: tuple[str, ...]) -> int | None:
    """The line of the first of ``keys`` in the YAML file ``path`` (None where it cannot be told)."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if text.strip().split(":", 1)[0].strip().strip("'\"") in keys:
                    return number
    except OSError:
        return None
    return None


def _env_int(name: str, raw: str) -> int:
    return v.parse_int_text(f"environment variable {name}", raw)


def _env_checkpointing(name: str, raw: str) -> bool | str:
    """true/false (and 1/0), or a mode's name (``full``, ``selective``)."""
    text = raw.strip().lower()
    return text if text in AC_MODES else _env_bool(name, text)


def _env_reshard(name: str, raw: str) -> bool | int:
    """true/false (and 1/0), or a group size of 2 or more."""
    text = raw.strip()
    return _env_int(name, text) if text.isdigit() and int(text) > 1 else _env_bool(name, text)
