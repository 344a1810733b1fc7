"""The fp8 recipe handlers: how ``mixed_precision="fp8"`` trains, one handler per fp8 library.

Accelerate 1.15's classes with its fields, defaults and ``ACCELERATE_FP8_*`` variables (a field
left None reads its variable when the handler is built, else takes Accelerate's default):

=================  ==========================================================  =================
handler            fields                                                      library
=================  ==========================================================  =================
AORecipeKwargs     config (a ``Float8LinearConfig``), module_filter_func,       torchao
                   pad_inner_dim, enable_fsdp_float8_all_gather
TERecipeKwargs     use_autocast_during_eval, margin, interval, fp8_format,     Transformer Engine
                   amax_history_len, amax_compute_algo,
                   override_linear_precision, use_mxfp8_block_scaling
MSAMPRecipeKwargs  opt_level                                                   MS-AMP
FP8RecipeKwargs    TERecipeKwargs's and MSAMPRecipeKwargs's, and backend       TE or MS-AMP
=================  ==========================================================  =================

Every field is checked at construction (errors name ``Class.field``, the value and what is
allowed; a value read from a variable names the variable too). Unlike Accelerate, building a
handler never needs its library: the Accelerator refuses a recipe whose library is missing,
and says why. ``FP8RecipeKwargs`` is deprecated as in Accelerate (a FutureWarning), and checks
MS-AMP's ``opt_level`` too (Accelerate's leaves it None). Importing this module imports
neither torch nor torchao.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.choices import (
    AMAX_COMPUTE_ALGOS,
    FP8_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPE_BACKENDS,
    OPT_LEVELS,
    FP8BackendType,
)
from hasten.settings.handlers import KwargsHandler

if TYPE_CHECKING:  # pragma: no cover
    from torchao.float8 import Float8LinearConfig

__all__ = [
    "AORecipeKwargs",
    "FP8BackendType",
    "FP8RecipeKwargs",
    "MSAMPRecipeKwargs",
    "RECIPE_KINDS",
    "TERecipeKwargs",
    "fp8_backend_from_env",
    "recipe_backend",
]

# ----------------------------------------------------------------------------- field rules
# A check takes (owner, field, value) and returns the value to keep (normalised), else raises.
_Check = Callable[[str, str, Any], Any]
# A reader takes the variable (or variables) and returns the default to use.
_Read = Callable[[Any], Any]


def _flag(default: bool) -> _Read:
    return lambda variable: env.env_flag(variable, default)


def _integer(default: int) -> _Read:
    return lambda variable: env.env_int(variable, default)


def _text(default: str) -> _Read:
    return lambda variable: env.env_text(variable) or default


def _bool(owner: str, field: str, value: Any) -> bool:
    return v.check_bool(owner, field, value)


def _at_least(bound: int) -> _Check:
    return lambda owner, field, value: v.check_number(owner, field, value, integer=True, ge=bound)


def _choice(choices: tuple[str, ...], fold: Callable[[str], str]) -> _Check:
    """One of ``choices`` in any case (``fold``: str.upper or str.lower gives the spelling kept)."""

    def check(owner: str, field: str, value: Any) -> str:
        folded = fold(str(value)) if isinstance(value, str) else None
        return v.check_choice(owner, field, folded if folded in choices else value, choices)

    return check


def _three_bools(owner: str, field: str, value: Any) -> tuple[bool, bool, bool]:
    what = "a tuple of three booleans (fprop, dgrad, wgrad), e.g. (False, False, False)"
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{owner}.{field} must be {what}, got {v.shown(value)} ({type(value).__name__})")
    if len(value) != 3:
        raise ValueError(f"{owner}.{field} must be {what}, got {v.shown(value)} ({len(value)} items)")
    for i, item in enumerate(value):
        v.check_bool(owner, f"{field}[{i}]", item)
    return (value[0], value[1], value[2])


def _override_flags(variables: tuple[str, ...]) -> tuple[bool, ...]:
    return tuple(env.env_flag(name) for name in variables)


# field -> (its variable(s), the default's reader, the check)
_Rules = dict[str, tuple[Any, _Read, _Check]]

_AO_RULES: _Rules = {
    "pad_inner_dim": (env.ACCELERATE_FP8_PAD_INNER_DIM, _flag(True), _bool),
    "enable_fsdp_float8_all_gather": (env.ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER, _flag(True), _bool),
}
_TE_RULES: _Rules = {
    "use_autocast_during_eval": (env.ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL, _flag(False), _bool),
    "margin": (env.ACCELERATE_FP8_MARGIN, _integer(0), _at_least(0)),
    "interval": (env.ACCELERATE_FP8_INTERVAL, _integer(1), _at_least(1)),
    "fp8_format": (env.ACCELERATE_FP8_FORMAT, _text("HYBRID"), _choice(FP8_FORMATS, str.upper)),
    "amax_history_len": (env.ACCELERATE_FP8_AMAX_HISTORY_LEN, _integer(1024), _at_least(1)),
    "amax_compute_algo": (
        env.ACCELERATE_FP8_AMAX_COMPUTE_ALGO,
        _text("most_recent"),
        _choice(AMAX_COMPUTE_ALGOS, str.lower),
    ),
    "override_linear_precision": (env.FP8_OVERRIDE_LINEAR_PRECISION, _override_flags, _three_bools),
    "use_mxfp8_block_scaling": (env.ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING, _flag(False), _bool),
}
_MSAMP_RULES: _Rules = {
    "opt_level": (env.ACCELERATE_FP8_OPT_LEVEL, _text("O2"), _choice(OPT_LEVELS, str.upper)),
}


def _default_recipe_backend(variable: str) -> str:
    """``FP8RecipeKwargs.backend``'s default: the variable, else MSAMP where MS-AMP is installed, else TE."""
    return env.env_text(variable) or ("MSAMP" if importlib.util.find_spec("msamp") is not None else "TE")


_BACKEND_RULES: _Rules = {
    "backend": (env.ACCELERATE_FP8_BACKEND, _default_recipe_backend, _choice(FP8_RECIPE_BACKENDS, str.upper)),
}


def _apply(handler: Any, rules: _Rules) -> None:
    """Fill each None field from its variable (or default), then check and normalise every field."""
    owner = type(handler).__name__
    for name, (variable, read, check) in rules.items():
        value, field = getattr(handler, name), name
        if value is None:
            names = variable if isinstance(variable, tuple) else (variable,)
            value, field = read(variable), f"{name} (from {', '.join(names)})"
        setattr(handler, name, check(owner, field, value))


# ----------------------------------------------------------------------------- torchao


def _is_float8_linear_config(value: Any) -> bool:
    """A torchao ``Float8LinearConfig`` (or a subclass), told by its class's name and package so that
    torchao need not be imported to check."""
    return any(
        cls.__name__ == "Float8LinearConfig" and cls.__module__.partition(".")[0] == "torchao"
        for cls in type(value).__mro__
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchao's first import prints a line per CUDA kernel library it cannot load (none on a
    CPU build) and torch logs a deprecation from its pytree registrations: kept off the output."""
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        pytree.setLevel(level)


@functools.cache
def torchao_float8() -> Any:
    """``torchao.float8`` (imported quietly, once), or None when torchao is not installed: what
    ``AORecipeKwargs`` builds its config from, and what the fp8 runtime (``hasten.training.float8``)
    converts models with."""
    if importlib.util.find_spec("torchao") is None:
        return None
    with _quiet():
        import torchao.float8 as float8
    return float8


def _linear_config(pad_inner_dim: bool, enable_fsdp_float8_all_gather: bool) -> Float8LinearConfig | None:
    """torchao's config from the two fields (None where torchao is absent)."""
    module = torchao_float8()
    if module is None:
        return None
    return module.Float8LinearConfig(
        pad_inner_dim=pad_inner_dim, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather
    )


@dataclass
class AORecipeKwargs(KwargsHandler):
    """fp8 training with torchao (``torchao.float8``).

    ``config``: a ``torchao.float8.Float8LinearConfig``; None builds one from ``pad_inner_dim`` and
    ``enable_fsdp_float8_all_gather`` (each None: ``ACCELERATE_FP8_PAD_INNER_DIM`` /
    ``ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER``, else True). With a config given, those two
    fields report the config's values (one given that disagrees with the config is refused).
    ``module_filter_func(module, name) -> bool``: which linear layers are converted (None: the
    runtime's default filter).
    """

    config: Float8LinearConfig | None = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        o = type(self).__name__
        v.check_callable(o, "module_filter_func", self.module_filter_func)
        for name in _AO_RULES:
            v.check_optional_bool(o, name, getattr(self, name))
        if self.config is None:
            _apply(self, _AO_RULES)
            self.config = _linear_config(self.pad_inner_dim, self.enable_fsdp_float8_all_gather)
            return
        if not _is_float8_linear_config(self.config):
            raise TypeError(
                f"{o}.config must be a torchao.float8.Float8LinearConfig or None, got {v.shown(self.config)} "
                f"({type(self.config).__name__})"
            )
        for name in _AO_RULES:
            given, in_config = getattr(self, name), getattr(self.config, name)
            if given is not None and given != in_config:
                raise ValueError(
                    f"{o}.{name}={given!r} disagrees with config.{name}={in_config!r}: set it in the "
                    f"Float8LinearConfig, or leave {name} None"
                )
            setattr(self, name, in_config)


@dataclass
class TERecipeKwargs(KwargsHandler):
    """fp8 training with Transformer Engine: the fields of its ``DelayedScaling`` recipe.

    ``fp8_format``: HYBRID (E4M3 forward, E5M2 backward), E4M3 or E5M2; ``amax_compute_algo``: max or
    most_recent; ``override_linear_precision``: (fprop, dgrad, wgrad) matmuls in higher precision;
    ``use_autocast_during_eval``: fp8 in eval mode too. Each None field reads its ``ACCELERATE_FP8_*``
    variable, else takes Accelerate's default (False, 0, 1, HYBRID, 1024, most_recent,
    (False, False, False), False).
    """

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        _apply(self, _TE_RULES)


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """fp8 training with MS-AMP: ``opt_level`` O1 or O2 (None: ``ACCELERATE_FP8_OPT_LEVEL``, else O2)."""

    opt_level: str | None = None

    def __post_init__(self) -> None:
        _apply(self, _MSAMP_RULES)


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in Accelerate): use TERecipeKwargs or MSAMPRecipeKwargs.

    ``backend``: TE or MSAMP (None: ``ACCELERATE_FP8_BACKEND``, else MSAMP where MS-AMP is
    installed, else TE); the fields of both are checked.
    """

    backend: str | None = None

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated (Accelerate removes it in v2.0): pass TERecipeKwargs or "
            "MSAMPRecipeKwargs instead",
            FutureWarning,
            stacklevel=3,  # the user's line (__post_init__ <- __init__ <- caller)
        )
        _apply(self, _BACKEND_RULES)
        _apply(self, _TE_RULES)
        _apply(self, _MSAMP_RULES)

    def to_kwargs(self) -> dict[str, Any]:
        with warnings.catch_warnings():  # the default instance compared with is not the user's
            warnings.simplefilter("ignore", FutureWarning)
            return super().to_kwargs()


# FP8RecipeKwargs first: it is a TERecipeKwargs and an MSAMPRecipeKwargs, and a kind of its own.
RECIPE_KINDS: tuple[type[KwargsHandler], ...] = (FP8RecipeKwargs, AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs)


def recipe_backend(handler: KwargsHandler) -> FP8BackendType:
    """The fp8 library a recipe handler asks for."""
    if isinstance(handler, FP8RecipeKwargs):
        return FP8BackendType(handler.backend)
    if isinstance(handler, AORecipeKwargs):
        return FP8BackendType.AO
    if isinstance(handler, TERecipeKwargs):
        return FP8BackendType.TE
    if isinstance(handler, MSAMPRecipeKwargs):
        return FP8BackendType.MSAMP
    raise TypeError(f"{v.shown(handler)} is not an fp8 recipe handler ({', '.join(k.__name__ for k in RECIPE_KINDS)})")


def fp8_backend_from_env() -> FP8BackendType:
    """``ACCELERATE_FP8_BACKEND`` (any case) as an FP8BackendType; NO when unset or empty."""
    raw = env.env_text(env.ACCELERATE_FP8_BACKEND)
    if raw is None:
        return FP8BackendType.NO
    if raw.strip().upper() not in FP8_BACKENDS:
        raise ValueError(
            f"environment variable {env.ACCELERATE_FP8_BACKEND} must be one of "
            f"{', '.join(map(repr, FP8_BACKENDS))} (any case), got {v.shown(raw)}"
        )
    return FP8BackendType(raw.strip().upper())
