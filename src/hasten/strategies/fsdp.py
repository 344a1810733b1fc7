"""FSDP2: sharded data parallelism with torch's ``fully_shard``, the only place it is called.

Consumes ``FullyShardedDataParallelPlugin``. ``setup_module`` applies, in one step and
bottom-up: activation checkpointing on the blocks the wrap policy picks, ``fully_shard`` on
each block, then on the root, all on a 1-D ``DeviceMesh`` over every process (a CPU mesh on
gloo), on the meta device: only each process's shards are then allocated and filled
(``materialise``: from each process's own copy, from the main process, or initialised; a
model built on meta works too). Parameters become DTensors holding 1/N of each tensor; the
optimizer built before ``prepare`` is rebound to them, and nothing keeps a full-size tensor. Mixed precision is FSDP's ``MixedPrecisionPolicy``
(parameters gathered in low precision, gradients reduced in fp32, fp32 master shards), so
the precision's autocast forward is not added. State dicts go through
``torch.distributed.checkpoint.state_dict`` (full ones with the model's own keys, gathered to
the main process on the CPU; sharded ones for ``torch.distributed.checkpoint``).

With a ``ParallelismConfig`` the mesh is the data dims of the run's N-D mesh: 2-D
``(dp_replicate, dp_shard_cp)`` for HSDP, else ``dp_shard_cp``; with ``tp_size > 1`` the
tensor-parallel plan (``tensor_parallel``) is applied on the meta device first, right after the
parameters are recorded (for the optimizer) and before activation checkpointing, compilation and
``fully_shard``, so FSDP shards DTensors that already hold 1/tp of each planned layer.

With one process there is no process group to shard over: the module is placed (a meta
model allocated and initialised) and given the autocast forward as on one device, and checkpoints still use the sharded ("dcp") layout,
so they load at any number of processes.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..state import DistributedType, init_mesh
from .base import Strategy, unwrap_compiled

if TYPE_CHECKING:  # pragma: no cover
    from ..compile import Compiler
    from ..options import FullyShardedDataParallelPlugin
    from ..parallelism_config import ParallelismConfig
    from ..precision import Precision
    from ..state import PartialState

#: FSDP2 averages gradients wrongly (a sum) on gloo before this release (pytorch#162338,
#: fixed on main on 2025-12-29 by pytorch#171458, after the 2.10 branch cut)
MIN_TORCH = (2, 11)


def check_torch_version(version: str = torch.__version__) -> None:
    """Refuse FSDP on a torch that averages FSDP2 gradients wrongly on gloo."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    found = (int(parts.group(1)), int(parts.group(2))) if parts else (0, 0)
    if found < MIN_TORCH:
        raise RuntimeError(
            f"FSDP in hasten needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {version}: older FSDP2 sums "
            "the gradients instead of averaging them on the gloo backend (pytorch/pytorch#162338). "
            "Upgrade torch, or train without fsdp_plugin (DDP)"
        )


def _is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class FSDP2Strategy(Strategy):
    """Several processes, each holding 1/N of every parameter, gradient and optimizer state."""

    name = "fsdp"
    distributed_type = DistributedType.FSDP

    def __init__(
        self,
        state: PartialState,
        precision: Precision,
        plugin: FullyShardedDataParallelPlugin,
        compiler: Compiler | None = None,
        parallelism: ParallelismConfig | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__(state, precision, compiler)
        check_torch_version()
        self.plugin = plugin
        #: N-D parallelism: the run's mesh (hasten.parallelism_config), None for a 1-D mesh over every process
        self.parallelism = parallelism
        self.device_mesh = device_mesh
        #: the mesh dim that tensor parallelism splits layers over (None: no TP)
        self.tp_mesh = device_mesh["tp"] if device_mesh is not None and parallelism.tp_enabled else None
        self.checkpoint_layout = "dcp" if plugin.state_dict_type == "SHARDED_STATE_DICT" else "full"
        self.sharded = state.use_distributed
        self._mesh: Any = None
        # id(parameter before sharding, now on meta) -> (a weak reference to it, the DTensor parameter
        # that replaced it); held weakly, so nothing here keeps a parameter of the unsharded model
        self._replaced: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}
        self._modules: list[torch.nn.Module] = []  # the prepared models, to find an optimizer's model
        if self.sharded and precision.scaler is not None:
            # fp16: the inf/nan check must agree on every process, each of which sees only its shards.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            kwargs = precision.scaler_handler.to_dict()  # GradScalerKwargs: the same fields as GradScaler
            for name in ("init_scale", "growth_factor", "backoff_factor"):
                kwargs[name] = float(kwargs[name])
            precision.scaler = ShardedGradScaler(state.device.type, **kwargs)

    # ------------------------------------------------------------------ modules
    @property
    def mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: 1-D over every process, or the data dims of the
        N-D mesh (2-D ``(dp_replicate, dp_shard_cp)`` for HSDP)."""
        if self._mesh is None:
            if self.device_mesh is not None:
                names = self.parallelism.fsdp_dim_names
                flat = self.parallelism.flattened.get("dp_shard_cp")
                self._mesh = self.device_mesh[tuple(names)] if len(names) > 1 or flat is None else flat
            else:
                self._mesh = init_mesh(self.state.device.type, (self.state.num_processes,))
        return self._mesh

    def setup_module(
        self, module: torch.nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        inner = unwrap_compiled(module)
        if isinstance(inner, DistributedDataParallel):
            raise ValueError(
                "prepare() got a model already wrapped in DistributedDataParallel, but this Accelerator shards "
                "with FSDP (fsdp_plugin): pass the plain module (model.module), hasten wraps it"
            )
        if _is_fsdp(inner):
            return module  # prepared (or sharded by the user) before
        blocks = self._blocks(inner)  # checks the wrap policy against the model, on every process count
        pending = None
        if self.sharded and not evaluation_mode:
            # Tensor parallelism first (torchtitan's order), on the meta device: the plan is
            # checked before anything changes, the parameters recorded before TP replaces them.
            plan = self._tensor_parallel_plan(inner)
            pending = self._to_meta(inner, adopted=plan is None and self.tp_mesh is not None)
            if plan:
                from .tensor_parallel import parallelize

                parallelize(inner, self.tp_mesh, plan)
        if self.plugin.activation_checkpointing:
            self._checkpoint_activations(inner, blocks)
        if not evaluation_mode:
            self._modules.append(inner)
        if not self.sharded or evaluation_mode:
            if not evaluation_mode:
                self._materialise_one_process(inner, device_placement)
            return super().setup_module(module, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # torchtitan's order: activation checkpointing, compile each block (in place), shard.
        compiled_blocks = self._compile_blocks(inner, blocks)
        self._shard(inner, blocks, pending)  # on the mesh's device, whatever device_placement says
        if self.compiler is not None and not compiled_blocks:
            return self.compiler.compile_whole(module)
        return module

    def _materialise_one_process(self, module: torch.nn.Module, device_placement: bool) -> None:
        """One process, nothing to shard: a model built on the meta device is allocated where it
        will run and initialised (or left unfilled) as the sharded path does."""
        from . import materialise as mat

        found = mat.survey(module, 1)
        if found.source == "init" or found.meta_buffers:
            mat.materialise_plain(module, self.state.device if device_placement else torch.device("cpu"))
            mat.fill(module, found, {}, self.state.device, True, self.plugin.param_init_fn)

    def _compile_blocks(self, module: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool:
        """Compile the repeated blocks (regional compilation) or else the sharded blocks, in place,
        before sharding; False if nothing was compiled (the whole model is then compiled after)."""
        if self.compiler is None:
            return False
        if self.compiler.regional:
            return self.compiler.compile_regions(module)
        for block in blocks:
            block.compile(**self.compiler.kwargs)
        return bool(blocks)

    def _blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules sharded as units of their own, innermost first (never the root)."""
        policy = self.plugin.auto_wrap_policy
        subs = [m for m in _post_order(module) if m is not module]
        if callable(policy):
            return [m for m in subs if policy(m)]
        if policy == "no_wrap":
            return []
        if policy == "transformer_based_wrap":
            wanted = self.plugin.transformer_cls_names_to_wrap or []
            present = {type(m).__name__ for m in module.modules()}
            missing = [n for n in wanted if n not in present]
            if missing:
                raise ValueError(
                    f"FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap names {missing}, which the model "
                    f"({type(module).__name__}) does not contain; its module classes are: {', '.join(sorted(present))}"
                )
            return [m for m in subs if type(m).__name__ in wanted]
        # size_based_wrap: a submodule whose parameters not yet in a block reach min_num_params
        threshold = self.plugin.min_num_params
        taken: set[int] = set()
        blocks = []
        for m in subs:
            params = [p for p in m.parameters() if id(p) not in taken]
            if sum(p.numel() for p in params) >= threshold:
                blocks.append(m)
                taken.update(id(p) for p in params)
        return blocks

    def _checkpoint_activations(self, module: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        targets = blocks or list(module.children())  # no wrap policy: each top-level child
        chosen = {id(b) for b in targets}
        wrapper = self.plugin.checkpoint_wrapper(pin_memory=self.state.device.type != "cpu")
        apply_activation_checkpointing(module, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)

    def _tensor_parallel_plan(self, module: torch.nn.Module) -> dict[str, str] | None:
        """The tensor-parallel plan on the module's names (checked), None without TP or for a
        model already parallelised (adopted as it is, never re-wrapped)."""
        if self.tp_mesh is None:
            return None
        from . import tensor_parallel as tp

        if tp.holds_dtensors(module):
            tp.check_adopted(module, self.tp_mesh)
            return None
        chosen, where = tp.model_plan(module, self.parallelism.tp_plan)
        return tp.resolve(module, chosen, where)

    def _to_meta(self, module: torch.nn.Module, adopted: bool = False) -> tuple[Any, ...]:
        """Survey, record the parameters by owner (to rebind optimizers built before prepare:
        the objects stay, now on meta), and move them to the meta device (not an adopted
        model's DTensors: those are sharded where they are)."""
        from . import materialise as mat

        ignored = self._ignored_params(module)
        before = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]
        if adopted:
            return None, ignored, before, None
        found = mat.survey(module, self.state.num_processes)
        unsharded = {id(p) for p in ignored}
        values = mat.to_meta(module, keep=lambda p: id(p) in unsharded)
        if found.source == "broadcast" and not self.state.is_main_process:
            values = {}  # what this process built is not used: freed here
        return found, ignored, before, values

    def _shard(self, module: torch.nn.Module, blocks: list[torch.nn.Module], pending: tuple[Any, ...]) -> None:
        """Shard ``module`` where it was built (see ``materialise``): (survey, to meta: done by
        ``_to_meta``), shard, materialise only the shards, fill them."""
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from . import materialise as mat

        plugin = self.plugin
        main = self.state.is_main_process
        device = self.state.device
        found, ignored, before, values = pending
        mp = plugin.mixed_precision(self.precision.mode)
        root_mp = mp
        if plugin.mixed_precision_policy is None and mp.param_dtype is not None:
            # outputs in fp32, as prepared models return them under autocast
            root_mp = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype, torch.float32, mp.cast_forward_inputs)
        offload = plugin.cpu_offload
        if offload is True:  # pinned host memory needs an accelerator
            offload = CPUOffloadPolicy(pin_memory=self.state.device.type != "cpu")
        elif offload is False:
            offload = OffloadPolicy()
        kwargs = dict(mesh=self.mesh, reshard_after_forward=plugin.reshard_after_forward,
                      offload_policy=offload, ignored_params=ignored or None)
        for block in blocks:
            fully_shard(block, mp_policy=mp, **kwargs)
        if kwargs["reshard_after_forward"] is True:
            # torch's own choice for the root: its parameters are gathered again right away for the
            # backward, so resharding them after forward would only add one all-gather per step
            kwargs["reshard_after_forward"] = None
        fully_shard(module, mp_policy=root_mp, **kwargs)
        if found is not None:
            param_device = torch.device("cpu") if plugin.cpu_offload is not False else device
            mat.materialise(module, param_device, device)
            mat.fill(module, found, values, device, main, plugin.param_init_fn)
        del values
        for owner, name, old in before:
            new = owner._parameters.get(name)
            if new is not None and new is not old:
                self._replaced[id(old)] = (weakref.ref(old, self._forget(id(old))), new)
        dist.barrier()

    def _forget(self, key: int) -> Callable[[Any], None]:
        return lambda _: self._replaced.pop(key, None)

    def _ignored_params(self, module: torch.nn.Module) -> set[torch.nn.Parameter]:
        ignored = self.plugin.ignored_modules
        if ignored is None:
            return set()
        if isinstance(ignored, str):
            modules = [m for n, m in module.named_modules() if re.search(ignored, n)]
        else:
            modules = list(ignored)
        return {p for m in modules for p in m.parameters()}

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point the optimizer at the sharded DTensor parameters, groups and hyperparameters kept."""
        if not self.sharded:
            return optimizer
        from torch.distributed.tensor import DTensor

        if optimizer.state and any(id(p) in self._replaced for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "prepare() got an optimizer that has already stepped on the unsharded parameters; with FSDP build "
                "it before any step (its state is created on the shards) or load its state after prepare"
            )
        stray = 0
        for group in optimizer.param_groups:
            params = [self._replaced[id(p)][1] if id(p) in self._replaced else p for p in group["params"]]
            stray += sum(not isinstance(p, DTensor) for p in params)
            group["params"] = params
        ignored = {id(p) for m in self._modules for p in self._ignored_params(m)}
        stray -= sum(id(p) in ignored for g in optimizer.param_groups for p in g["params"])
        if stray:
            raise ValueError(
                f"prepare() got an optimizer with {stray} parameter(s) that belong to no model sharded by this "
                "Accelerator: prepare the model before the optimizer, or both in one prepare(model, optimizer) call"
            )
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return _no_gradient_sync(inner) if _is_fsdp(inner) else contextlib.nullcontext()

    def trigger_sync_in_backward(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = unwrap_compiled(module)
        return _gradient_sync_on(inner) if _is_fsdp(inner) else contextlib.nullcontext()

    # ------------------------------------------------------------------ state dicts
    def model_state_dict(self, module: torch.nn.Module, full: bool = True, *, check_filled: bool = True) -> dict[str, Any]:
        """Full: gathered to the main process on the CPU (empty elsewhere). Not full: this
        process's shards as DTensors, with the global shapes (what ``torch.distributed.checkpoint`` saves).
        A model built on the meta device with tensors nothing has filled is refused (``check_filled``)."""
        inner = self.unwrap(module)
        if check_filled:
            from .materialise import require_filled

            require_filled(inner, "saving the model")
        if not _is_fsdp(inner):
            return inner.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def load_model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Every process passes the full state dict (each keeps its shards), or a sharded one."""
        from .materialise import mark_filled

        inner = self.unwrap(module)
        if not _is_fsdp(inner):
            result = inner.load_state_dict(state_dict, strict=strict)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = not _has_dtensor(state_dict)
            result = set_model_state_dict(inner, state_dict, options=StateDictOptions(full_state_dict=full, strict=strict))
        mark_filled(inner, state_dict.keys())
        return result

    def model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
        """The prepared model whose parameters ``optimizer`` updates (None if none)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owners = [m for m in self._modules if any(id(p) in mine for p in m.parameters())]
        if len(owners) > 1:
            raise ValueError(
                "an optimizer updates the parameters of several FSDP models; hasten checkpoints an FSDP optimizer "
                "with its one model: build one optimizer per model"
            )
        return owners[0] if owners else None

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, full: bool = True) -> dict[str, Any]:
        """Keyed by parameter names; full: gathered to the main process on the CPU."""
        model = self.model_of(optimizer)
        if model is None:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, getattr(optimizer, "optimizer", optimizer),
            options=StateDictOptions(full_state_dict=full, cpu_offload=full),
        )

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        model = self.model_of(optimizer)
        if model is None:
            optimizer.load_state_dict(state_dict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model, getattr(optimizer, "optimizer", optimizer), state_dict,
            # full: each process keeps its part of the full state; a plain (one-process) model takes it as is
            options=StateDictOptions(full_state_dict=_is_fsdp(model) and not _has_dtensor(state_dict.get("state", {}))),
        )

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every shard; the same (plain) tensor on every process."""
        if self.tp_mesh is not None:  # DTensors on several sub-meshes (data dims, data x tp)
            from .tensor_parallel import clip_grad_norm_

            return clip_grad_norm_(parameters, max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.state.device}, num_processes={self.state.num_processes}, sharded={self.sharded})"


@contextlib.contextmanager
def _no_gradient_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    module._hasten_no_sync = True
    try:
        yield
    finally:
        module._hasten_no_sync = False
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _gradient_sync_on(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(True)
    try:
        yield
    finally:
        if getattr(module, "_hasten_no_sync", False):  # back to no_sync's setting
            module.set_requires_gradient_sync(False)


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _has_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return any(_has_dtensor(x) for x in obj.values())
    return False
