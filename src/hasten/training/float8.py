"""fp8 training: the one module that consumes the fp8 recipe handlers (``AORecipeKwargs``,
``TERecipeKwargs``, ``MSAMPRecipeKwargs``, ``FP8RecipeKwargs``).

What is decided once, at ``Accelerator(mixed_precision="fp8")``, is a frozen :class:`Float8Plan`
(:func:`plan_float8`): the torchao ``Float8LinearConfig``, which ``nn.Linear`` layers are
converted (Accelerate's filter unless the handler gives one: the first and last Linear stay in
high precision, and any whose dimensions are not multiples of 16), whether the weights are
all-gathered in float8 under FSDP2, and whether the matmuls are emulated (a CPU has no fp8
matmul: torchao's emulation casts to fp8 and back exactly as the GPU kernels do, then multiplies
in high precision). TransformerEngine and MS-AMP are refused there unless their package and a
GPU that runs fp8 are present, naming what is missing and the torchao backend instead.

What ``prepare`` does, once, as the first step of the parallelize pipeline (before tensor
parallelism, activation checkpointing, compile and FSDP: torchtitan's order) is
:func:`apply_float8`: torchao's ``convert_to_float8_training`` on the model, returning the
parameters it replaced (an optimizer built before ``prepare`` is pointed at them). With float8
all-gather under FSDP2, the per-step scale precompute runs after each optimizer step
(:func:`precompute_scales`, registered by the strategy), not in the user's loop.

Checkpoints and exported weights hold plain tensors (:func:`plain_state_dict`): the float8
layers keep ``nn.Linear``'s names, so what ``save_model`` writes loads into the unconverted model.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hasten.settings.recipes import torchao_float8

#: the pip extra that installs torchao
INSTALL_HINT = "pip install 'hasten[fp8]' (torchao)"
BACKENDS = ("AO", "TE", "MSAMP")


# ---------------------------------------------------------------------------- torchao
def require_torchao(what: str) -> Any:
    module = torchao_float8()
    if module is None:
        raise ImportError(f"{what} needs torchao, which is not installed: {INSTALL_HINT}")
    return module


def linear_config(pad_inner_dim: bool = True, enable_fsdp_float8_all_gather: bool = True) -> Any:
    """torchao's ``Float8LinearConfig`` with these two fields (Accelerate's defaults), or None
    when torchao is not installed (``AORecipeKwargs`` leaves its config unset then)."""
    module = torchao_float8()
    if module is None:
        return None
    return module.Float8LinearConfig(
        pad_inner_dim=pad_inner_dim, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather
    )


def runs_natively(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether this machine multiplies in fp8 (a CUDA GPU of compute capability 8.9 or newer),
    and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU: torchao emulates fp8 (casts to fp8 and back, matmuls in high precision)"
    index = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, f"the GPU has compute capability {major}.{minor}; fp8 matmuls need 8.9 (Ada, Hopper) or newer"
    return True, f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"


# ---------------------------------------------------------------------------- the filter
def first_and_last_linear(model: nn.Module) -> tuple[str | None, str | None]:
    """The names of the first and last ``nn.Linear`` of ``model`` (in module order)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def default_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Accelerate's filter: every ``nn.Linear`` whose in and out features are multiples of 16,
    except the model's first and last (kept in high precision for stability)."""
    kept = set(first_and_last_linear(model))

    def convert(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
            return False
        return fqn not in kept

    return convert


def chosen_layers(model: nn.Module, module_filter: Callable[[nn.Module, str], bool] | None) -> list[str]:
    """The names of the ``nn.Linear`` layers the filter converts (what :func:`apply_float8` converts)."""
    check = module_filter or default_filter(model)
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and _ask(check, m, name)]


def _ask(check: Callable[[nn.Module, str], bool], module: nn.Module, name: str) -> bool:
    answer = check(module, name)
    if not isinstance(answer, bool):
        raise TypeError(
            f"AORecipeKwargs.module_filter_func must return True or False for (module, name), got "
            f"{type(answer).__name__} {answer!r} for {name!r}"
        )
    return answer


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Float8Plan:
    """What fp8 does to every prepared model, decided at ``Accelerator(...)``."""

    #: torchao's ``Float8LinearConfig`` (``emulate`` set where the device has no fp8 matmul)
    config: Any
    #: ``(module, name) -> bool``: which ``nn.Linear`` layers are converted (None: Accelerate's filter)
    module_filter: Callable[[nn.Module, str], bool] | None = None
    #: cast the input of each converted layer to the CPU autocast dtype, as torchao does for CUDA's
    cpu_autocast_input: bool = False
    #: FSDP2 shards over several processes on gloo, which cannot all-gather float8 bytes alone: a
    #: unit holding only float8 weights gathers them in high precision
    gloo: bool = False

    @property
    def all_gather(self) -> bool:
        """Weights all-gathered in float8 under FSDP2 (then scales are precomputed each step)."""
        return bool(self.config.enable_fsdp_float8_all_gather)


def installed_backend() -> str:
    """The fp8 backend when none is named (by a recipe handler or ``ACCELERATE_FP8_BACKEND``, which
    the settings resolve): torchao when installed, then TransformerEngine, then MS-AMP (Accelerate's order)."""
    import importlib.util

    for backend, module in (("AO", "torchao"), ("TE", "transformer_engine"), ("MSAMP", "msamp")):
        if importlib.util.find_spec(module) is not None:
            return backend
    raise ImportError(
        f"mixed_precision='fp8' needs an fp8 backend and none is installed: {INSTALL_HINT}, which also runs on a "
        "CPU (or TransformerEngine / MS-AMP on a GPU that runs fp8)"
    )


@dataclass(frozen=True)
class TransformerEnginePlan:
    """fp8 with NVIDIA TransformerEngine: ``nn.Linear`` (dims multiples of 16) and ``nn.LayerNorm``
    become TransformerEngine's layers, and the forward runs under its ``fp8_autocast`` with the
    recipe of ``TERecipeKwargs`` (or ``FP8RecipeKwargs(backend="TE")``), as Accelerate does."""

    handler: Any


def plan_float8(
    handler: Any, backend: str, device: torch.device, *, sharded: bool, process_group_backend: str | None
) -> Float8Plan | TransformerEnginePlan | None:
    """The plan for ``mixed_precision="fp8"`` with ``handler`` (the recipe handler given or made
    by default) on ``backend`` ("AO", "TE" or "MSAMP"); refuses what this machine cannot run.
    None for MS-AMP: ``prepare`` hands its model and optimizer to ``msamp.initialize`` instead."""
    if backend in ("TE", "MSAMP"):
        refuse_unavailable(backend, device)
        if backend == "MSAMP" and sharded:
            raise ValueError(
                "mixed_precision='fp8' with MS-AMP does not run under FSDP (as in Accelerate): use the torchao "
                "backend (AORecipeKwargs), which composes with FSDP2 and tensor parallelism"
            )
        return TransformerEnginePlan(handler) if backend == "TE" else None
    require_torchao("mixed_precision='fp8' (AORecipeKwargs)")
    config = handler.config
    if config is None:
        config = linear_config(handler.pad_inner_dim is not False, handler.enable_fsdp_float8_all_gather is not False)
    native, _ = runs_natively(device)
    if not native and not config.emulate:
        config = dataclasses.replace(config, emulate=True)
        if device.type == "cpu":
            _say_emulated()
    return Float8Plan(
        config,
        handler.module_filter_func,
        cpu_autocast_input=device.type == "cpu",
        gloo=sharded and process_group_backend == "gloo",
    )


@functools.cache
def _say_emulated() -> None:
    warnings.warn(
        "mixed_precision='fp8' on a CPU: torchao emulates the fp8 matmuls (inputs and weights are cast to fp8 "
        "and back as on a GPU, then multiplied in high precision): the numbers of an fp8 run, not its speed",
        UserWarning,
        stacklevel=4,
    )


_PACKAGES = {"TE": ("transformer_engine", "TransformerEngine"), "MSAMP": ("msamp", "MS-AMP")}


def refuse_unavailable(backend: str, device: torch.device) -> None:
    """TransformerEngine and MS-AMP need their package and a CUDA GPU that runs fp8."""
    import importlib.util

    module, name = _PACKAGES[backend]
    missing = []
    if importlib.util.find_spec(module) is None:
        missing.append(f"the {name} package ({module}) is not installed")
    native, why = runs_natively(device)
    if not native:
        missing.append(why)
    if missing:
        raise ValueError(
            f"mixed_precision='fp8' with the {name} backend cannot run here: {'; '.join(missing)}. Use the torchao "
            f"backend instead (kwargs_handlers=[AORecipeKwargs()], {INSTALL_HINT}), which also runs on a CPU"
        )


# ---------------------------------------------------------------------------- prepare's step
def apply_float8(
    module: nn.Module, plan: Float8Plan | TransformerEnginePlan | None
) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Convert ``module``'s chosen ``nn.Linear`` layers to torchao's float8 layers in place
    (TransformerEngine's layers with its plan); returns ``(old, new)`` for each parameter the
    conversion replaced. Layers converted before (a model prepared twice) are left as they are."""
    if plan is None:
        return []
    if isinstance(plan, TransformerEnginePlan):
        return apply_transformer_engine(module, plan)
    float8 = require_torchao("mixed_precision='fp8'")
    names = set(chosen_layers(module, plan.module_filter))
    if not names:
        _say_nothing_converted(module, plan.module_filter)
        return []
    before = dict(module.named_parameters(remove_duplicate=False))
    float8.convert_to_float8_training(module, config=plan.config, module_filter_fn=lambda m, fqn: fqn in names)
    converted = [m for name, m in module.named_modules() if name in names]
    if plan.cpu_autocast_input:
        for layer in converted:
            layer.register_forward_pre_hook(_cpu_autocast_input)
    after = dict(module.named_parameters(remove_duplicate=False))
    return [(old, after[name]) for name, old in before.items() if name in after and after[name] is not old]


def _say_nothing_converted(module: nn.Module, module_filter: Callable[[nn.Module, str], bool] | None) -> None:
    """One warning where fp8 converts no layer of ``module``, naming why (nothing is said for a
    model whose layers an earlier ``prepare`` converted)."""
    linears = [(n, m) for n, m in module.named_modules() if type(m) is nn.Linear]
    if any(type(m).__name__ == "Float8Linear" for m in module.modules()):
        return
    if not linears:
        why = "it has no torch.nn.Linear layer (only those are converted)"
    elif module_filter is not None:
        why = f"AORecipeKwargs.module_filter_func refused all of its {len(linears)} nn.Linear layer(s)"
    else:
        kept = set(first_and_last_linear(module))
        odd = [n for n, m in linears if n not in kept and (m.in_features % 16 or m.out_features % 16)]
        parts = []
        if kept:
            parts.append(f"{len(kept)} are its first or last layer, kept in high precision ({', '.join(sorted(kept))})")
        if odd:
            shown = ", ".join(odd[:5]) + (", ..." if len(odd) > 5 else "")
            parts.append(f"{len(odd)} have in/out features that are not multiples of 16 ({shown})")
        why = f"of its {len(linears)} nn.Linear layer(s), " + " and ".join(parts)
    warnings.warn(
        f"mixed_precision='fp8' converted no layer of {type(module).__name__} to float8: {why}; the model trains in "
        "the higher precision. Pass AORecipeKwargs(module_filter_func=...) to choose layers yourself",
        UserWarning,
        stacklevel=2,
    )


def apply_transformer_engine(module: nn.Module, plan: TransformerEnginePlan) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """TransformerEngine's layers in place of ``nn.Linear`` (dims multiples of 16) and
    ``nn.LayerNorm``, their values copied; the forward under ``fp8_autocast`` (in training, and in
    evaluation with ``use_autocast_during_eval``)."""
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    before = dict(module.named_parameters(remove_duplicate=False))
    for name, child in list(module.named_modules()):
        if name and isinstance(child, (nn.Linear, nn.LayerNorm)):
            _swap_te(module, name, child, te)
    after = dict(module.named_parameters(remove_duplicate=False))
    kwargs = {k: getattr(plan.handler, k) for k in ("margin", "interval", "amax_history_len", "amax_compute_algo")}
    kwargs["fp8_format"] = getattr(te_recipe.Format, plan.handler.fp8_format)
    kwargs["override_linear_precision"] = tuple(plan.handler.override_linear_precision)
    if plan.handler.use_mxfp8_block_scaling:
        recipe = te_recipe.MXFP8BlockScaling(fp8_format=kwargs["fp8_format"])
    else:
        recipe = te_recipe.DelayedScaling(**kwargs)
    during_eval = bool(plan.handler.use_autocast_during_eval)
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kw: Any) -> Any:
        with te.fp8_autocast(enabled=during_eval or module.training, fp8_recipe=recipe):
            return original(*args, **kw)

    module.forward = forward
    return [(old, after[n]) for n, old in before.items() if n in after and after[n] is not old]


def _swap_te(root: nn.Module, name: str, child: nn.Module, te: Any) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    with torch.no_grad():
        if isinstance(child, nn.Linear):
            if child.in_features % 16 or child.out_features % 16:
                return
            new = te.Linear(
                child.in_features, child.out_features, bias=child.bias is not None, params_dtype=child.weight.dtype
            )
        else:
            new = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=child.weight.dtype)
        new.weight.copy_(child.weight)
        if getattr(child, "bias", None) is not None:
            new.bias.copy_(child.bias)
    setattr(parent, attr, new)


def msamp_initialize(objects: tuple[Any, ...], opt_level: str) -> tuple[Any, ...]:
    """MS-AMP: the one model and one optimizer of a ``prepare`` call through ``msamp.initialize``
    (as Accelerate does); other objects as they are. Both must come in the same call."""
    models = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
    optimizers = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer)]
    if not models and not optimizers:
        return objects
    if len(models) != 1 or len(optimizers) != 1:
        raise ValueError(
            "mixed_precision='fp8' with MS-AMP: pass one model and one optimizer together to prepare(), got "
            f"{len(models)} model(s) and {len(optimizers)} optimizer(s)"
        )
    import msamp

    model, optimizer = msamp.initialize(objects[models[0]], objects[optimizers[0]], opt_level=opt_level)
    result = list(objects)
    result[models[0]], result[optimizers[0]] = model, optimizer
    return tuple(result)


def _cpu_autocast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    # torchao's float8 layer casts its input to the autocast dtype of CUDA only; under CPU
    # autocast the same cast, so a CPU run multiplies what a GPU run multiplies.
    if args and torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def gather_in_high_precision(
    units: list[nn.Module], root: nn.Module, plan: Float8Plan | None
) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """On gloo, a FSDP unit whose own parameters are all float8-gathered weights cannot be
    all-gathered (gloo has no float8 type): those layers gather their weights in high precision
    instead (the matmuls still run in fp8). Returns ``(old, new)`` for each weight replaced."""
    if plan is None or not plan.gloo or not plan.all_gather:
        return []
    replaced = []
    for unit, params in _own_parameters(units, root).items():
        if not params or not all(_is_float8_weight(p) for p in params):
            continue
        own = {id(p) for p in params}
        for layer in unit.modules():
            weight = getattr(layer, "weight", None)
            if isinstance(weight, nn.Parameter) and id(weight) in own:
                layer.weight = nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)
                layer.config = dataclasses.replace(layer.config, enable_fsdp_float8_all_gather=False)
                replaced.append((weight, layer.weight))
    return replaced


def _own_parameters(units: list[nn.Module], root: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """Each unit's parameters (innermost units first), not counting those of units inside it;
    the root holds the rest."""
    taken: set[int] = set()
    owned: dict[nn.Module, list[nn.Parameter]] = {}
    for unit in [*units, root]:
        params = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        owned[unit] = params
    return owned


def precompute_scales(model: nn.Module) -> Callable[..., None]:
    """The optimizer post-step hook of a model sharded with float8 all-gather: one all-reduce per
    mesh computes the scales of the float8 weights on it for the next step's all-gather (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` stacks every weight's amax, which DTensors on
    different meshes refuse: tensor-parallel weights beside FSDP-only ones, a pipeline stage)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    found: dict[str, list[nn.ModuleList]] = {}  # at the first step (the model is wrapped by then), kept

    def precompute(*args: Any, **kwargs: Any) -> None:
        if "groups" not in found:
            found["groups"] = _float8_layers_by_mesh(model)
        for group in found["groups"]:
            precompute_float8_dynamic_scale_for_fsdp(group)

    return precompute


def _float8_layers_by_mesh(model: nn.Module) -> list[nn.ModuleList]:
    """``model``'s float8 layers whose weights are DTensors, grouped by their weight's mesh and
    placements (each group a ``ModuleList`` holding them, which owns nothing new)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[int, tuple[Any, ...]], list[nn.Module]] = {}
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if type(m).__name__ == "Float8Linear" and isinstance(weight, DTensor):
            groups.setdefault((id(weight.device_mesh), tuple(weight.placements)), []).append(m)
    return [nn.ModuleList(layers) for layers in groups.values()]


# ---------------------------------------------------------------------------- checkpoints
def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with torchao's float8-gathered weight tensors (also inside DTensors, and in
    an optimizer's nested state) replaced by the plain tensors they hold (same storage)."""
    return _plain(state_dict)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if not isinstance(value, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value._local_tensor
        inner = getattr(local, "_tensor", None)
        if inner is None or not _is_float8_weight(local):
            return value
        return DTensor.from_local(
            inner.detach(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value._tensor.detach() if _is_float8_weight(value) else value  # the same storage


def _is_float8_weight(t: torch.Tensor) -> bool:
    return type(t).__name__ == "WeightWithDynamicFloat8CastTensor"
