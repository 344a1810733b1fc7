"""The strategy interface and what every strategy shares."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from hasten.strategies.parallelize import ModelParts, ParallelizePlan, ParamSwaps, parallelize
from hasten.training.compile import is_compiled, unwrap_compiled  # noqa: F401 - unwrap_compiled: for the strategies

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import ProcessState
    from hasten.training.compile import Compiler
    from hasten.training.precision import Precision


def strip_wrappers(
    module: torch.nn.Module,
    inner: Callable[[torch.nn.Module], torch.nn.Module | None],
    keep_torch_compile: bool = False,
) -> torch.nn.Module:
    """``module`` without ``torch.compile``'s wrappers, those ``inner`` opens and the user's own
    ``DataParallel``/``DistributedDataParallel``, in any nesting (as Accelerate unwraps).

    With ``keep_torch_compile`` the module is returned compiled where it was: the compiled
    wrapper nearest to it when that wraps it directly, else a new wrapper with the same compile
    settings around it (the original, e.g. around DDP, is left as it is and keeps training).
    """
    compiled = None
    while True:
        if is_compiled(module):
            compiled = module
            module = module._orig_mod
            continue
        opened = inner(module)
        if opened is None and (isinstance(module, _PARALLEL) or getattr(type(module), "_hasten_wrapper", False)):
            opened = module.module  # DDP/DataParallel, or hasten's pipeline parallel part
        if opened is None:
            break
        module = opened
    if not keep_torch_compile or compiled is None:
        return module
    if compiled._orig_mod is module:
        return compiled
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule(module, compiled.dynamo_ctx)


_PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def is_collective_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward or backward runs collectives the other processes must join:
    DDP, FSDP (torch's FSDP1 and FSDP2 modules) or hasten's pipeline part. The strategies make
    these wrappers, so this is where they are recognised."""
    import sys

    if isinstance(module, torch.nn.parallel.DistributedDataParallel) or getattr(type(module), "_hasten_wrapper", False):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded wherever such a module exists
    kinds = tuple(t for t in (getattr(fsdp, "FullyShardedDataParallel", None), getattr(fsdp, "FSDPModule", None)) if t)
    return bool(kinds) and isinstance(module, kinds)


_WRAPPER_PREFIX = re.compile(r"(^|\.)(?:_orig_mod|module)\.")


def own_keys(state_dict: dict[str, Any], expected: Iterable[str]) -> dict[str, Any]:
    """``state_dict`` with the names ``expected`` has: an entry whose name is not expected but
    becomes so without ``torch.compile``'s ``_orig_mod.`` or DDP's ``module.`` segments (a state
    dict other tools wrote from a wrapped model) is renamed."""
    expected = set(expected)
    if all(k in expected for k in state_dict):
        return state_dict
    out = {}
    for key, value in state_dict.items():
        if key not in expected:
            bare, stripped = key, None
            while stripped != bare:  # nested wrappers: module._orig_mod.x
                stripped, bare = bare, _WRAPPER_PREFIX.sub(r"\1", bare)
            key = bare if bare in expected else key
        out[key] = value
    return out


def has_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (a tensor or nested dicts of them) holds a DTensor: a sharded state dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return any(has_dtensor(x) for x in obj.values())
    return False


# ---------------------------------------------------------------------------- optimizer state, two keyings
def param_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of ``model``'s parameters, under the names its state dict uses
    (no activation-checkpointing, ``torch.compile`` or DDP segments: torch's canonical names)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(model, name)
        out.setdefault(id(p), next(iter(fqns)) if len(fqns) == 1 else name)
    return out


def keyed_by_ids(state_dict: Any) -> bool:
    """Whether an optimizer state dict is torch's own (parameters by their index in the groups),
    not keyed by parameter names (``torch.distributed.checkpoint``'s form)."""
    groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
    params = [p for g in groups if isinstance(g, dict) for p in g.get("params", [])]
    keys = list(state_dict.get("state", {})) if isinstance(state_dict, dict) else []
    return any(isinstance(k, int) for k in params + keys)


def by_names(state_dict: dict[str, Any], names: list[list[str]], where: str = "the optimizer state") -> dict[str, Any]:
    """An optimizer state dict keyed by parameter names, from torch's own keyed by index (as it
    is where it is keyed by names already); ``names``: each group's parameter names, in order."""
    if not keyed_by_ids(state_dict):
        return state_dict
    groups = state_dict.get("param_groups", [])
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(n) for n in names]:
        raise ValueError(
            f"{where} has parameter groups of sizes {sizes}, the prepared optimizer {[len(n) for n in names]}"
        )
    index = {i: name for g, group_names in zip(groups, names) for i, name in zip(g["params"], group_names)}
    unknown = [k for k in state_dict.get("state", {}) if k not in index]
    if unknown:
        raise ValueError(f"{where} holds the state of parameter(s) {unknown[:5]} that no parameter group lists")
    return {
        "state": {index[k]: v for k, v in state_dict.get("state", {}).items()},
        "param_groups": [{**g, "params": list(n)} for g, n in zip(groups, names)],
    }


def by_ids(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """torch's own optimizer state dict (parameters by index), from one keyed by names (as it is
    where it is torch's already); ``names``: each group's parameter names, in the optimizer's order."""
    if keyed_by_ids(state_dict) or not state_dict.get("param_groups"):
        return state_dict
    index = {name: i for i, name in enumerate(n for group in names for n in group)}
    saved = state_dict["param_groups"]
    return {
        "state": {index[k]: v for k, v in state_dict.get("state", {}).items() if k in index},
        "param_groups": [{**g, "params": [index[n] for n in group]} for g, group in zip(saved, names)],
    }


class Strategy:
    """How one Accelerator places, wraps, synchronises and checkpoints its models.

    Subclasses override ``_wrap`` (or ``wrap_model``, and whatever else differs) and may extend
    ``plan``; the defaults are those of a module that is not wrapped at all.
    """

    name = "single"
    #: the checkpoint layout (a name in hasten.checkpoint.layouts) that save_state writes
    checkpoint_layout = "full"
    #: what ``Accelerator.distributed_type`` reports; None: the process state's (NO, MULTI_CPU, MULTI_GPU)
    distributed_type: Any = None

    def __init__(self, state: ProcessState, precision: Precision, compiler: Compiler | None = None) -> None:
        self.state = state
        self.precision = precision
        #: what setup_module does to every model (parallelize.py), decided here, once
        self.plan = ParallelizePlan(device=state.device, precision=precision, compile=compiler)
        #: the parameters prepare replaced (float8 layers, DTensors), for optimizers built before
        self.swaps = ParamSwaps()
        self._modules: list[torch.nn.Module] = []  # the prepared models, to find an optimizer's model

    @property
    def compiler(self) -> Compiler | None:
        """torch.compile, applied at setup_module (None: models run eagerly)."""
        return self.plan.compile

    # ------------------------------------------------------------------ modules
    def setup_module(
        self, module: torch.nn.Module, *, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """``module`` through the parallelize pipeline (``parallelize.parallelize``): placed,
        given the autocast forward, its repeated blocks compiled (regional compilation),
        wrapped (not with ``evaluation_mode``), the whole compiled (otherwise)."""
        plan = self.plan.for_call(device_placement, evaluation_mode)
        prepared = parallelize(module, self.unwrap(module), plan, self.wrap_model, self.swaps)
        if not evaluation_mode:
            self._modules.append(self.unwrap(prepared))
        return prepared

    def wrap_model(self, model: torch.nn.Module, parts: ModelParts) -> torch.nn.Module:
        """The pipeline's wrapping step: ``model`` in this strategy's wrapper (``_wrap``)."""
        return self._wrap(model)

    def _wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, rebound to the parameters a step of ``prepare`` replaced (the float8
        layers' weights with fp8); replicating wrappers keep the module's own parameters."""
        self.swaps.rebind(optimizer)
        return optimizer

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Inside the block, backward accumulates gradients locally without synchronising them."""
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The next backward inside the block synchronises gradients, even after forwards run
        under ``no_sync`` (several forwards, then several backwards)."""
        return contextlib.nullcontext()

    def _inner(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The module inside this strategy's wrapper, or None if ``module`` is not one."""
        return None

    def unwrap(self, module: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
        """The user's own module, without this strategy's wrapper and ``torch.compile``'s.

        With ``keep_torch_compile`` the compiled wrapper nearest to the user's module is
        returned where there is one (Accelerate's ``unwrap_model(..., keep_torch_compile=True)``).
        """
        return strip_wrappers(module, self._inner, keep_torch_compile)

    # ------------------------------------------------------------------ state dicts
    def model_state_dict(
        self, module: torch.nn.Module, full: bool = True, *, check_filled: bool = True
    ) -> dict[str, Any]:
        """The full state dict, with the model's own keys (no wrapper prefixes).

        With ``full=False`` a sharding strategy returns this process's shards (DTensors with the
        global shapes) instead of gathering them; the others return the full one either way.
        ``check_filled=False``: a template to load into (a strategy that builds models on the
        meta device refuses to save tensors nothing has filled, but may load into them).
        A dispatched model's offloaded weights (on meta between forwards) are read from where they
        were offloaded, one module at a time (Accelerate's ``get_state_dict_offloaded_model``).
        """
        from hasten.big_model.align import get_state_dict_offloaded_model, has_offloaded_params

        inner = self.unwrap(module)
        if any(has_offloaded_params(m) for m in inner.modules()):
            return self.plain(get_state_dict_offloaded_model(inner))
        return self.plain(inner.state_dict())

    def plain(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with plain tensors where fp8 made the weights torchao's tensors (what
        checkpoints and exported weights hold); as it is without fp8."""
        if self.plan.float8 is None:
            return state_dict
        from hasten.training.float8 import plain_state_dict

        return plain_state_dict(state_dict)

    def load_model_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
        inner = self.unwrap(module)
        return inner.load_state_dict(own_keys(state_dict, inner.state_dict().keys()), strict=strict)

    def model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
        """The prepared model whose parameters ``optimizer`` updates (None if none)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owners = [m for m in self._modules if any(id(p) in mine for p in m.parameters())]
        if len(owners) > 1:
            raise ValueError(
                "an optimizer updates the parameters of several prepared models; hasten checkpoints an optimizer "
                "with its one model: build one optimizer per model"
            )
        return owners[0] if owners else None

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, full: bool = True) -> dict[str, Any]:
        """Full: torch's own state dict (parameters by their index in the groups: what the "full"
        layout writes). Not full: keyed by parameter names, as a sharding strategy's
        (``torch.distributed.checkpoint``'s form; torch creates the state of an optimizer that has
        not stepped, with a step at lr 0, to have tensors to read a checkpoint into)."""
        model = None if full else self.model_of(optimizer)
        if model is None:
            return self.plain(optimizer.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        inner = getattr(optimizer, "optimizer", optimizer)
        return self.plain(get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=False)))

    def optimizer_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        """Each parameter group's parameter names (the whole model's, in the optimizer's order):
        what turns a state dict keyed by index into one keyed by names. A collective where a
        process holds part of the model (pipeline stages); a parameter of no prepared model is
        named by its place (``"<group>.<index>"``), as are those of an optimizer of several models."""
        opt = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for g in opt.param_groups for p in g["params"]}
        owners = [m for m in self._modules if any(id(p) in mine for p in m.parameters())]
        names = param_names(owners[0]) if len(owners) == 1 else {}  # several models: by place
        return [
            [names.get(id(p), f"{g}.{i}") for i, p in enumerate(group["params"])]
            for g, group in enumerate(opt.param_groups)
        ]

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """``state_dict`` keyed by index (torch's own) or by parameter names (plain tensors)."""
        optimizer.load_state_dict(by_ids(state_dict, self.optimizer_names(optimizer)))

    def whole_tensor_table(self, module: torch.nn.Module, table: dict[str, Any]) -> dict[str, Any]:
        """The tensor table (names -> shape, dtype) a checkpoint records for ``module``, from
        ``table``, this process's: the same, where every process holds the whole model."""
        return table

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``parameters``; returns their total norm."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.state.device}, num_processes={self.state.num_processes})"
