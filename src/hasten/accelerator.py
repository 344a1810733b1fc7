"""The Accelerator: a thin facade that composes hasten's modules.

Each method delegates to one module (settings, state, precision, strategies, registry, data,
optim, ops, profiling, checkpoint) or is a one-liner. Several Accelerators may live in one process with different
precision and handlers: only the process group is shared.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from hasten import _validate as v
from hasten import checkpoint
from hasten.data_loader.core import PreparedDataLoader
from hasten.data_loader.prepare import prepare_loader
from hasten.distributed import ops, processes
from hasten.distributed.facts import ProcessFacts
from hasten.distributed.state import DistributedType, LoopState, RunState, set_current
from hasten.settings import parallelism as nd
from hasten.settings.choices import FP8BackendType
from hasten.settings.fault_tolerance import FaultToleranceKwargs, implied_by_ray
from hasten.settings.handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from hasten.settings.plugins import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from hasten.settings.recipes import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from hasten.settings.resolve import EVEN_BATCHES_DEFAULT, SPLIT_BATCHES_DEFAULT, resolve
from hasten.strategies import Strategy, choose_strategy, fault_tolerance, sequence_parallel, shards_gradients
from hasten.tracking import GeneralTracker, LoggerType, Trackers
from hasten.training import float8
from hasten.training.optimizer import AcceleratedOptimizer
from hasten.training.precision import Precision
from hasten.training.registry import PreparedObjects
from hasten.training.scheduler import AcceleratedScheduler


class Accelerator(ProcessFacts):
    """Runs one training loop on CPU, one GPU or many processes, with mixed precision and DDP.

    The arguments are Accelerate's, with its defaults; an argument in code wins over the launcher's
    flags, the ``HASTEN_*``/``ACCELERATE_*`` environment and the config file. Besides the properties
    and methods below, each Accelerator has these attributes:

    - `state`: the run's process facts (device, ranks, process group; `RunState`).
    - `gradient_state`: the loop's position (`sync_gradients`, `end_of_dataloader`, accumulation steps).
    - `precision`: the one object that owns autocast and the gradient scaler (`Precision`).
    - `strategy`: how prepared models are wrapped, synchronised, clipped and checkpointed (`Strategy`).
    - `registry`: the models, optimizers, schedulers, dataloaders and registered objects prepared so far.
    - `checkpoint_state`: the checkpoint last saved or loaded (`CheckpointInfo`), None before.
    - `dataloader_config`, `project_configuration`, `fsdp_plugin`, `parallelism_config`, `dynamo_plugin`:
      the configurations in use (the arguments', else the environment's and the config file's).
    - `autocast_handler`, `ddp_handler`, `scaler_handler`, `init_handler`, `profile_handler`,
      `fault_tolerance_handler`, `fp8_recipe_handler`, `ao_recipe_handler`, `te_recipe_handler`,
      `msamp_recipe_handler`: the kwargs handler of each kind in use, None where none is.
    - `device_placement`, `step_scheduler_with_optimizer`: the arguments of those names.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = SPLIT_BATCHES_DEFAULT,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        log_with: str | LoggerType | GeneralTracker | list[str | LoggerType | GeneralTracker] | None = None,
        even_batches: bool = EVEN_BATCHES_DEFAULT,
        step_scheduler_with_optimizer: bool = True,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        parallelism_config: nd.ParallelismConfig | None = None,
        **unexpected: Any,
    ) -> None:
        settings = resolve(
            split_batches=split_batches,
            even_batches=even_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            kwargs_handlers=kwargs_handlers,
            dataloader_config=dataloader_config,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            unexpected=unexpected,
            fsdp_plugin=fsdp_plugin,
            parallelism_config=parallelism_config,
            flags={
                "device_placement": device_placement,
                "cpu": cpu,
                "step_scheduler_with_optimizer": step_scheduler_with_optimizer,
            },
        )
        self._keep_settings(settings, device_placement, step_scheduler_with_optimizer)
        self._start(settings, cpu)
        self._build_parts(log_with)

    def _keep_settings(self, settings: Any, device_placement: bool, step_scheduler_with_optimizer: bool) -> None:
        """The resolved arguments, as Accelerate's attributes of the same names."""
        self.dataloader_config = settings.dataloader_config
        self.project_configuration = settings.project_config
        self.autocast_handler: AutocastKwargs | None = settings.handler(AutocastKwargs)
        self.ddp_handler: DistributedDataParallelKwargs | None = settings.handler(DistributedDataParallelKwargs)
        self.scaler_handler: GradScalerKwargs | None = settings.handler(GradScalerKwargs)
        self.init_handler: InitProcessGroupKwargs | None = settings.handler(InitProcessGroupKwargs)
        self.profile_handler: ProfileKwargs | None = settings.handler(ProfileKwargs)
        # under Ray Train's TorchftConfig (each worker a replica group of its own) on without the handler too
        self.fault_tolerance_handler: FaultToleranceKwargs | None = (
            settings.handler(FaultToleranceKwargs) or implied_by_ray()
        )
        self.fsdp_plugin: FullyShardedDataParallelPlugin | None = settings.fsdp_plugin
        self.parallelism_config: nd.ParallelismConfig | None = settings.parallelism_config
        self.dynamo_plugin = settings.dynamo_plugin
        self.fp8_recipe_handler: FP8RecipeKwargs | None = settings.handler(FP8RecipeKwargs)
        self.ao_recipe_handler: AORecipeKwargs | None = settings.handler(AORecipeKwargs)
        self.te_recipe_handler: TERecipeKwargs | None = settings.handler(TERecipeKwargs)
        self.msamp_recipe_handler: MSAMPRecipeKwargs | None = settings.handler(MSAMPRecipeKwargs)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer

    def _start(self, settings: Any, cpu: bool) -> None:
        """The process group and mesh, mixed precision and the loop's state."""
        self.state = RunState(cpu, self.init_handler)
        self.state.fsdp_plugin = self.fsdp_plugin  # Accelerate's accelerator.state.fsdp_plugin
        # N-D parallelism: the mesh, built once; the data pipeline sees the data-parallel ranks only
        self._mesh = nd.build_mesh(self.parallelism_config, self.state.num_processes, self.state.device.type)
        self._data_state = nd.data_view(self.state, self.parallelism_config)
        # where several processes read each batch (pp, tp, cp): the ranks whose metrics stand for each data rank
        self._data_ranks = nd.data_representatives(self.parallelism_config, self._data_state)
        sharded = shards_gradients(self.state, self.fsdp_plugin, self.parallelism_config, self._mesh)
        self._fp8 = self._choose_fp8(settings) if settings.mixed_precision == "fp8" else None
        self.precision = Precision(
            settings.mixed_precision, self.state.device, self.autocast_handler, self.scaler_handler, sharded=sharded,
            loss_scaling=self.fp8_backend == FP8BackendType.MSAMP,  # MS-AMP scales the loss (as in Accelerate)
        )  # fmt: skip
        self.state.mixed_precision = self.precision.mode
        steps, plugin = settings.gradient_accumulation_steps, settings.accumulation_plugin
        if plugin is None:
            self.gradient_state = LoopState(steps)
        else:
            self.gradient_state = LoopState(
                steps, sync_with_dataloader=plugin.sync_with_dataloader, sync_each_batch=plugin.sync_each_batch
            )
        set_current(self.state, self.gradient_state)

    _RECIPES = {"AO": (AORecipeKwargs, "ao_recipe_handler"), "TE": (TERecipeKwargs, "te_recipe_handler")}
    _RECIPES["MSAMP"] = (MSAMPRecipeKwargs, "msamp_recipe_handler")

    def _choose_fp8(self, settings: Any) -> tuple[str, Any]:
        """fp8's backend (the settings' choice, else an installed one) and recipe handler
        (Accelerate's default handler of the backend when none is given)."""
        named = settings.fp8_backend
        backend = float8.installed_backend() if named == FP8BackendType.NO else named.value
        handler = settings.recipe_handler
        if handler is None:
            kind, attribute = self._RECIPES[backend]
            handler = kind()
            setattr(self, attribute, handler)
        return backend, handler

    @property
    def fp8_enabled(self) -> bool:
        """``mixed_precision="fp8"``."""
        return self._fp8 is not None

    has_fp8_handler = fp8_enabled  # Accelerate's two names; hasten makes the default handler when none is given
    """``mixed_precision="fp8"`` (Accelerate's other name for `fp8_enabled`)."""

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The fp8 backend (``FP8BackendType.NO`` without fp8)."""
        return FP8BackendType(self._fp8[0]) if self._fp8 is not None else FP8BackendType.NO

    def _build_parts(self, log_with: Any) -> None:
        """The strategy, the record of prepared objects, the trackers and the checkpointer."""
        self.registry = PreparedObjects()
        self._fault_tolerance = fault_tolerance.start(  # torchft's manager, None without FaultToleranceKwargs
            self.fault_tolerance_handler, self.state, self.registry, self.fsdp_plugin, self.parallelism_config
        )
        self._data_state = fault_tolerance.data_view(self._fault_tolerance, self._data_state)
        self.strategy: Strategy = choose_strategy(
            self.state, self.precision, self.ddp_handler, self.dynamo_plugin, self.fsdp_plugin,
            self.parallelism_config, self._mesh, self._fp8, self._fault_tolerance,
        )  # fmt: skip
        implied = getattr(self.strategy, "plugin", None)
        if self.fsdp_plugin is None and isinstance(implied, FullyShardedDataParallelPlugin):
            # an N-D mesh (tp, cp) shards with FSDP2 without a plugin: the state names the one it runs with, so
            # transformers' Trainer saves and resumes by FSDP's paths (every process gathers), not rank 0 alone
            self.state.fsdp_plugin = implied
        self._trackers = Trackers(log_with, self.logging_dir, self.is_main_process)
        self._save_model_state_pre_hook: dict[int, Callable[..., None]] = OrderedDict()
        self._load_model_state_pre_hook: dict[int, Callable[..., None]] = OrderedDict()
        parts = checkpoint.Checkpointable(
            self.state, self.registry, self.strategy, self.precision, self.gradient_state,
            self.project_configuration, self._save_model_state_pre_hook, self._load_model_state_pre_hook,
            self._fault_tolerance,
        )  # fmt: skip
        # The barrier: given to each optimizer prepared, for async saves.
        self._checkpointer = checkpoint.Checkpointer(parts, checkpoint.CopyBarrier())
        self._checkpointer.claim_project_dir()  # a folder in use is refused now, before any work
        self._trigger = processes.Trigger(self.device)
        if self.use_distributed:
            from hasten.utils.other import check_os_kernel

            check_os_kernel()
        self.checkpoint_state: checkpoint.CheckpointInfo | None = None  # the last save_state/load_state

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager:
        """The sequences split: over ``sp`` (Ulysses), or torch's ``context_parallel`` on ``cp`` (recreate it
        each step); nothing with both sizes 1."""
        return sequence_parallel.maybe_context_parallel(
            self.parallelism_config, self._mesh, buffers, buffer_seq_dims, no_restore_buffers
        )

    # Accelerate's names for the prepared objects (scripts and its tests read them; ``_models`` is also assigned).
    _models = property(lambda self: self.registry.models, lambda self, models: _refill(self.registry.models, models))
    _optimizers = property(lambda self: self.registry.optimizers)
    _schedulers = property(lambda self: self.registry.schedulers)
    _dataloaders = property(lambda self: self.registry.dataloaders)
    _custom_objects = property(lambda self: self.registry.custom_objects)

    @property
    def split_batches(self) -> bool:
        """Each batch of a prepared dataloader is split across the processes (else each process reads a batch of its
        own)."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """The main process reads each batch and sends each process its part (`DataLoaderConfiguration`)."""
        return self.dataloader_config.dispatch_batches

    @property
    def use_seedable_sampler(self) -> bool:
        """Prepared dataloaders shuffle with a seeded sampler, the same order on every process and after a resume."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Batches are copied to the device asynchronously (from pinned memory)."""
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self) -> str | None:
        """The project folder (`ProjectConfiguration.project_dir`); checkpoints go to its `checkpoints/`."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where trackers write their logs (`ProjectConfiguration.logging_dir`)."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets (`checkpoint_N`)."""
        return self.project_configuration.iteration

    @property
    def even_batches(self) -> bool:
        """With uneven data, the last batches are padded so every process gets as many batches (settable)."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = v.check_bool("Accelerator", "even_batches", value)

    @property
    def distributed_type(self) -> DistributedType:
        """`DistributedType` of the run (NO, MULTI_CPU, MULTI_GPU, FSDP ...: how prepared models are wrapped)."""
        return self.strategy.distributed_type or self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        """The mixed precision in use: "no", "fp16", "bf16" or "fp8"."""
        return self.precision.mode

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (None without fp16)."""
        return self.precision.scaler

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step synchronises gradients (the last of `gradient_accumulation_steps`, or the
        end of the data)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = v.check_bool("Accelerator", "sync_gradients", value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step; `accumulate()` syncs on the last one and `backward` divides the
        loss by it (settable)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.num_steps = v.check_number(
            "Accelerator", "gradient_accumulation_steps", steps, integer=True, ge=1
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken with synchronised gradients (fp16-skipped ones included); checkpointed.
        With FaultToleranceKwargs: the steps committed across replica groups (torchft's manager's)."""
        return self.registry.sync_steps() if self._fault_tolerance is None else self._fault_tolerance.step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16: the gradients held inf or NaN)."""
        return any(o.step_was_skipped for o in self.registry.optimizers)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order."""
        if device_placement is not None and not isinstance(device_placement, (list, tuple)):
            raise TypeError(
                f"prepare.device_placement must be a list of True/False, one per object, got {device_placement!r}"
            )
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        placement = device_placement or [self.device_placement] * len(args)
        _ = self.state.device  # after AcceleratorState._reset_state() this raises, saying so, before any change
        for obj in args:
            _warn_if_unpreparable(obj)
        if self.fp8_backend == FP8BackendType.MSAMP:
            args = float8.msamp_initialize(args, self._fp8[1].opt_level)
        # Models first (optimizers keep their parameters through .to()), schedulers last.
        order = sorted(range(len(args)), key=lambda i: _prepare_rank(args[i]))
        result: list[Any] = list(args)
        for i in order:
            obj = args[i]
            if isinstance(obj, torch.nn.Module):
                result[i] = self.prepare_model(obj, device_placement=placement[i])
            elif isinstance(obj, torch.optim.Optimizer):
                result[i] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=placement[i])
            elif isinstance(obj, (*_SCHEDULER_TYPES, AcceleratedScheduler)):
                result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place, add the autocast forward and wrap (DDP; not with ``evaluation_mode``: inference only)."""
        if _holds(self.registry.models, model):
            return model  # prepared by this Accelerator already: not wrapped twice
        _refuse_offloaded_quantized(model)
        model = self.strategy.setup_module(
            model,
            device_placement=device_placement if device_placement is not None else self.device_placement,
            evaluation_mode=v.check_bool("prepare_model", "evaluation_mode", evaluation_mode),
        )
        self.registry.models.append(model)
        return _mark_prepared(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so its step unscales, skips inf/NaN steps (fp16) and steps only when gradients sync."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        wrapped = AcceleratedOptimizer(
            self.strategy.setup_optimizer(optimizer), self.precision, self.gradient_state, self._checkpointer.barrier
        )
        self.registry.optimizers.append(wrapped)
        return _mark_prepared(wrapped)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> PreparedDataLoader:
        """Shard ``data_loader`` across the data-parallel processes and move its batches to `device`
        (``device_placement``)."""
        if _holds(self.registry.dataloaders, data_loader):
            return data_loader
        place = device_placement if device_placement is not None else self.device_placement
        loader = prepare_loader(
            data_loader,
            self._data_state,
            self.gradient_state,
            device_placement=place,
            split_batches=self.split_batches,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            dispatch_batches=nd.dispatch_setting(self._data_state, self.dispatch_batches, self.parallelism_config),
        )
        self.registry.dataloaders.append(loader)
        return _mark_prepared(loader)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap an LR scheduler so it steps only after optimizer steps (and, with ``split_batches=False``, once per
        process)."""
        if _holds(self.registry.schedulers, scheduler):
            return scheduler
        optimizers = self.registry.optimizers_of(getattr(scheduler, "optimizer", None))
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers,
            self.step_scheduler_with_optimizer,
            self.split_batches,
            self._data_state.num_processes,
        )
        self.registry.schedulers.append(wrapped)
        return _mark_prepared(wrapped)

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with loss scaling, divided by the accumulation steps."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        try:
            self.precision.backward(loss, **kwargs)
        except AttributeError:
            if isinstance(loss, torch.Tensor):
                raise
            raise TypeError(f"backward() takes the loss as a torch.Tensor, got {type(loss).__name__}") from None

    def pipeline_step(
        self, model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward of one batch: ``loss_fn(model(*inputs), targets)``, the batch's
        mean loss. With pipeline parallelism (``ParallelismConfig.pp_size > 1``) through every
        stage, microbatch by microbatch as the schedule orders them (only the first stage reads
        ``inputs``, only the last ``targets``); without, as ``accelerator.backward`` after the
        forward, so one loop runs either way. Divided by ``gradient_accumulation_steps`` for the
        backward as ``backward`` does; under ``torch.no_grad()`` the forward only. Returns the
        batch's mean loss (detached), the same on every process of a pipeline."""
        from hasten.strategies.pipeline_parallel.schedule import pipeline_step

        return pipeline_step(model, inputs, targets, loss_fn, self.gradient_state.num_steps, self.backward)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Accelerate's backward for LOMO optimizers (``lomo_optim``): refused, by name."""
        raise NotImplementedError(
            "lomo_backward: hasten does not run LOMO optimizers (lomo_optim's fused backward-and-update); "
            "train with a torch optimizer and accelerator.backward(loss)"
        )

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Autocast to the mixed precision inside the block (prepared models' forwards already do);
        ``autocast_handler`` overrides the Accelerator's."""
        return self.precision.autocast(autocast_handler)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync only on the last of ``gradient_accumulation_steps``."""
        sync = self.gradient_state.advance() or self.gradient_state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip the gradient synchronisation of a prepared model inside the block."""
        return self.strategy.no_sync(model)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The backward inside the block synchronises gradients although the forward ran under
        ``no_sync`` (several forwards, then several backwards: sync at the last one)."""
        return self.strategy.trigger_sync_in_backward(model)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | list | None = None) -> None:
        """Unscale the fp16 gradients of ``optimizer`` (a list, or every prepared one by default), once per step."""
        optimizers = (
            self.registry.optimizers if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        )
        for opt in optimizers:
            self.precision.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale fp16 gradients (once per step), then clip; returns the total norm."""
        if self.sync_gradients:
            self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale fp16 gradients (once per step), then clamp each gradient to ``[-clip_value, clip_value]``."""
        if self.sync_gradients:
            self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or each tensor of a list, tuple or dict) from every process along dim 0; every
        process gets it."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather; in the last batch of a prepared dataloader keep only its real samples (padding out)."""
        tensors_only = not use_gather_object and _all_tensors(input_data)
        ranks = self._data_ranks
        if tensors_only:
            gathered = ops.gather(input_data)
        else:  # one list per process where only some processes' parts are kept
            gathered = ops.gather_object(input_data if ranks is None else [input_data])
        if ranks is not None:  # each data rank's metrics once
            gathered = nd.keep_data_ranks(gathered, ranks, self.num_processes, not tensors_only)
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else 0
        if remainder <= 0:
            return gathered
        if tensors_only:
            return ops.recursively_apply(lambda t: t[:remainder], gathered)
        return gathered[:remainder]

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` (or each tensor of a nest) across processes: "sum", "mean", "max", "min", "product";
        times ``scale``."""
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad ``tensor`` along ``dim`` with ``pad_index`` to the largest size on any process (before the start with
        ``pad_first``), so it can be gathered."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this line (a barrier; nothing with one process)."""
        self.state.wait_for_everyone()

    # ------------------------------------------------------------------ processes
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only (once per machine)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # The process helpers are the state's (as Accelerate's Accelerator, which calls its state's).
    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The main process runs the block first (e.g. to download or cache), then the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """The local main process of each machine runs the block first, then the others of that machine."""
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on the main process only (others get None)."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on each machine's local main process only (others get None)."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on the last process only (everywhere with one process)."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: run ``function`` on process ``process_index`` only; ``@on_process(process_index=1)`` too."""
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorator: run ``function`` on local process ``local_process_index`` of each machine only."""
        return self.state.on_local_process(function, local_process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` reports on every process."""
        self._trigger.set()

    def check_trigger(self) -> bool:
        """True on every process if any process called ``set_trigger`` since the last check (a collective)."""
        return self._trigger.check()

    def join_uneven_inputs(
        self, joinables: list, even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager:
        """``torch.distributed.algorithms.Join`` over ``joinables`` (e.g. DDP models) for uneven batches.

        ``even_batches`` overrides the prepared map-style dataloaders' setting inside the block.
        """
        return processes.join_uneven_inputs(
            self.state, self.registry.dataloaders, joinables, even_batches, self.even_batches
        )

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """Inside the block, this process's contiguous share of ``inputs`` (a list, tuple, tensor or dict of them);
        ``apply_padding`` repeats the last item so every share has the same length."""
        return self.state.split_between_processes(inputs, apply_padding)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """The same prepared dataloader, whose next iteration skips ``num_batches`` batches."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError("skip_first_batches() takes a dataloader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state_dict, with the model's own keys with ``unwrap`` (no ``module.``/``_orig_mod.``)."""
        return self.strategy.model_state_dict(model) if unwrap else model.state_dict()

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = False
    ) -> torch.nn.Module:
        """The user's own module, without DDP and ``torch.compile``'s wrapper (kept with ``keep_torch_compile``).

        Its forward still autocasts under mixed precision unless ``keep_fp32_wrapper=False``,
        which removes the autocast forward for good (as in Accelerate), on any number of processes.
        """
        inner = self.strategy.unwrap(model, keep_torch_compile=keep_torch_compile)
        if not keep_fp32_wrapper:
            Precision.unwrap_forward(self.strategy.unwrap(model))
        return inner

    # ------------------------------------------------------------------ checkpoints (hasten.checkpoint)
    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        *,
        total_limit: int | None = None,
        async_save: bool | None = None,
    ) -> str:
        """Save everything needed to resume exactly (models, optimizers, schedulers, scaler, RNG states,
        dataloader positions, registered objects); returns the directory. Call it on every process.

        Without ``output_dir``: ``project_dir/checkpoints/checkpoint_N``; ``total_limit`` (else
        ``ProjectConfiguration.total_limit``) keeps the newest N there. ``async_save=True`` (else
        ``ProjectConfiguration.async_save``) returns once the state is taken and writes in the background.
        ``output_dir`` may be a URL (``s3://...``). Details: ``hasten.checkpoint.Checkpointer.save_state``."""
        self.checkpoint_state = self._checkpointer.save_state(
            output_dir, total_limit=total_limit, safe_serialization=safe_serialization, async_save=async_save
        )
        return self.checkpoint_state.directory

    def load_state(
        self,
        input_dir: str | os.PathLike | None = None,
        *,
        weights_only: bool = True,
        verify_checksums: bool = True,
        strict_world_size: bool = False,
        missing_ok: bool = False,
    ) -> str | None:
        """Restore a `save_state` checkpoint, at this or another number of processes; returns the directory.
        Call it on every process: every file is read and checked before any object changes.

        Without ``input_dir``: the newest ``project_dir/checkpoints/checkpoint_N`` (None with
        ``missing_ok=True`` when there is none yet). ``strict_world_size=True`` refuses a checkpoint of
        another number of processes; ``verify_checksums`` checks the files against the manifest;
        ``weights_only=False`` unpickles objects of your own classes (a trusted checkpoint only).
        Details: ``hasten.checkpoint.Checkpointer.load_state``."""
        found = self._checkpointer.load_state(
            input_dir,
            weights_only=weights_only,
            verify_checksums=verify_checksums,
            strict_world_size=strict_world_size,
            missing_ok=missing_ok,
        )
        if found is not None:
            self.checkpoint_state = found
        return None if found is None else found.directory

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> list[str]:
        """Write ``model``'s full weights to ``save_directory`` (safetensors, sharded above ``max_shard_size``; main
        process only); returns the files' paths."""
        return checkpoint.save_model(self._checkpointer.ctx, model, save_directory, max_shard_size, safe_serialization)

    def load_model(self, model: torch.nn.Module, directory: str | os.PathLike, weights_only: bool = True) -> None:
        """Load model files (``save_model``'s or Hugging Face's) into a prepared model; a sharded
        one reads only its own slices of safetensors files (see checkpoint.load_model)."""
        checkpoint.load_model(
            model, directory, weights_only, strategy=self.strategy, barrier=self._checkpointer.barrier
        )

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save(obj, f)`` on the main process only, replacing a file atomically (safetensors with
        ``safe_serialization``)."""
        checkpoint.save(self._checkpointer.ctx, obj, f, safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load ``objects`` (each with ``state_dict`` and ``load_state_dict``) with `save_state` and
        `load_state`."""
        self.registry.custom_objects.extend(checkpoint.check_registrable(objects))

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before anything is written."""
        return checkpoint.register_hook(self._save_model_state_pre_hook, hook, "register_save_state_pre_hook")

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before anything is read."""
        return checkpoint.register_hook(self._load_model_state_pre_hook, hook, "register_load_state_pre_hook")

    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager:
        """Profile the block; labels forward/backward/optimizer step/data wait (see profiling.py)."""
        from hasten.training.profiling import profile

        return profile(profile_handler or self.profile_handler, self.registry, self.precision, self.state)

    def record_function(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the trace while ``profile()`` is active (context manager or decorator)."""
        from hasten.training.profiling import record_function

        return record_function(name)

    # ------------------------------------------------------------------ trackers (tracking.py)
    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers this process uses (main-process-only ones are absent on the other processes)."""
        return self._trackers.active

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the ``log_with`` trackers for ``project_name``; ``init_kwargs={"wandb": {...}}`` per tracker."""
        self._trackers.init(project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log ``values`` to every tracker (main process only for main-process-only trackers)."""
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap``); a do-nothing one where unused."""
        return self._trackers.get(name, unwrap)

    def wait_for_checkpoint(self) -> None:
        """Wait for the asynchronous ``save_state`` in flight (if any); raise its error (see
        checkpoint.Checkpointer.wait)."""
        self._checkpointer.wait()

    def end_training(self) -> None:
        """Finish the trackers and any asynchronous save (its host copy freed), leave torchft's quorum (with
        FaultToleranceKwargs), wait for every process, then destroy the process group."""
        import torch.distributed as dist

        self._trackers.finish()
        self._checkpointer.release()
        if self._fault_tolerance is not None:
            self._fault_tolerance.shutdown()

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget the prepared objects and an async save's host copy (and empty the CUDA cache); a None per object."""
        self._checkpointer.release()
        self.registry.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory
    """Accelerate's other name for `free_memory`."""

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
            f"device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


# ---------------------------------------------------------------------- helpers


_SCHEDULER_TYPES: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler,)
if hasattr(torch.optim.lr_scheduler, "ReduceLROnPlateau"):
    _SCHEDULER_TYPES += (torch.optim.lr_scheduler.ReduceLROnPlateau,)


def _warn_if_unpreparable(obj: Any) -> None:
    """Objects prepare() does not know are returned unchanged, as Accelerate does (None silently);
    a class, or a model that cannot be trained, is refused before anything is prepared."""
    if isinstance(obj, torch.nn.Module):
        _refuse_offloaded_quantized(obj)  # before prepare() changes anything
        return
    if obj is None or isinstance(obj, (torch.optim.Optimizer, DataLoader, *_SCHEDULER_TYPES, AcceleratedScheduler)):
        return
    if isinstance(obj, type):
        raise TypeError(
            f"prepare() cannot prepare the class {obj.__name__}, only objects: it takes torch.nn.Module, "
            "torch.optim.Optimizer, torch.utils.data.DataLoader and torch.optim.lr_scheduler objects (make one first)"
        )
    warnings.warn(
        f"prepare() returns {type(obj).__name__} unchanged: it prepares torch.nn.Module, torch.optim.Optimizer, "
        "torch.utils.data.DataLoader and torch.optim.lr_scheduler objects",
        stacklevel=3,
    )


def _refuse_offloaded_quantized(model: torch.nn.Module) -> None:
    """A model loaded in 8/4-bit (bitsandbytes) with parts offloaded to the CPU or disk cannot train."""
    if getattr(model, "is_loaded_in_8bit", False) is True or getattr(model, "is_loaded_in_4bit", False) is True:
        device_map = getattr(model, "hf_device_map", None)
        if isinstance(device_map, dict) and any(str(d) in ("cpu", "disk") for d in device_map.values()):
            raise ValueError(
                f"prepare_model: {type(model).__name__} is loaded in 8-bit or 4-bit precision with CPU or disk offload "
                f"(hf_device_map={device_map!r}); such a model cannot be trained: load it on the accelerator only "
                "(device_map without 'cpu'/'disk')"
            )


def _holds(prepared: list[Any], obj: Any) -> bool:
    return any(p is obj for p in prepared)


def _refill(models: list[torch.nn.Module], new: Any) -> None:
    """``accelerator._models = [...]`` (a plain list in Accelerate): the same list, which checkpoints read, refilled."""
    if not isinstance(new, (list, tuple)):
        raise TypeError(f"Accelerator._models takes a list of torch.nn.Module, got a {type(new).__name__}")
    for i, m in enumerate(new):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"Accelerator._models takes a list of torch.nn.Module; item {i} is a {type(m).__name__}")
    models[:] = new


def _mark_prepared(obj: Any) -> Any:
    """Accelerate's marker of prepared objects (scripts test it)."""
    obj._is_accelerate_prepared = True
    return obj


def _prepare_rank(obj: Any) -> int:
    if isinstance(obj, torch.nn.Module):
        return 0
    if isinstance(obj, torch.optim.Optimizer):
        return 1
    if isinstance(obj, DataLoader):
        return 2
    return 3


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(x) for x in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_all_tensors(x) for x in data)
    return False
