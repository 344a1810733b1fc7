"""Resolving the Accelerator's arguments: code, else the launcher's environment, else the config file.

This is the one place that reconciles the settings ``hasten launch`` passes on (environment
variables, named and read through :mod:`hasten.settings.environment`; the config file's handlers) with
the arguments written in code: code wins, and where the two disagree a one-line warning says
so. ``resolve`` returns everything the Accelerator builds its parts from, validated. Importing
this module does not import torch.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.choices import MIXED_PRECISION_CHOICES, FP8BackendType
from hasten.settings.fault_tolerance import FaultToleranceKwargs
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
    _optional_path,
    use_fsdp_from_env,
)
from hasten.settings.recipes import RECIPE_KINDS, fp8_backend_from_env, recipe_backend

_HANDLER_KINDS: tuple[type[KwargsHandler], ...] = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    FaultToleranceKwargs,
    *RECIPE_KINDS,  # FP8RecipeKwargs before TERecipeKwargs and MSAMPRecipeKwargs, its bases
)

_INIT_ARGS = (
    "device_placement",
    "split_batches",
    "mixed_precision",
    "gradient_accumulation_steps",
    "cpu",
    "kwargs_handlers",
    "dataloader_config",
    "project_dir",
    "project_config",
    "gradient_accumulation_plugin",
    "fsdp_plugin",
    "parallelism_config",
    "log_with",
    "even_batches",
    "step_scheduler_with_optimizer",
    "dynamo_backend",
    "dynamo_plugin",
)


def sort_handlers(handlers: Any) -> dict[type[KwargsHandler], KwargsHandler]:
    """One handler of each kind, matched with ``isinstance`` (user subclasses work)."""
    if handlers is None:
        return {}
    if isinstance(handlers, KwargsHandler) or not isinstance(handlers, (list, tuple)):
        raise TypeError(f"kwargs_handlers must be a list of kwargs handlers, got {handlers!r}")
    found: dict[type[KwargsHandler], KwargsHandler] = {}
    for handler in handlers:
        kind = next((k for k in _HANDLER_KINDS if isinstance(handler, k)), None)
        if kind is None:
            allowed = ", ".join(k.__name__ for k in _HANDLER_KINDS)
            raise TypeError(f"kwargs_handlers got {handler!r} ({type(handler).__name__}); allowed: {allowed}")
        if kind in found:
            raise ValueError(
                f"kwargs_handlers holds two {kind.__name__} objects ({found[kind]!r} and {handler!r}); pass one"
            )
        recipe = next((h for k, h in found.items() if k in RECIPE_KINDS), None) if kind in RECIPE_KINDS else None
        if recipe is not None:
            raise ValueError(
                f"kwargs_handlers holds two fp8 recipe handlers ({type(recipe).__name__} and "
                f"{type(handler).__name__}); pass one: it picks the fp8 library (AORecipeKwargs: torchao, "
                "TERecipeKwargs: Transformer Engine, MSAMPRecipeKwargs: MS-AMP)"
            )
        found[kind] = handler
    return found


def fp8_setting(
    handlers: dict[type[KwargsHandler], KwargsHandler],
    mixed_precision: str,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    parallelism_config: Any,
) -> FP8BackendType:
    """The fp8 library: the recipe handler's, else ``ACCELERATE_FP8_BACKEND``'s, else NO.

    A recipe handler needs ``mixed_precision="fp8"`` (as in Accelerate, FSDP is let through: there a
    handler may come before the precision). Where the launcher named another library, the handler in
    code wins and a one-line warning says so."""
    launcher = fp8_backend_from_env()
    recipe = next((h for k, h in handlers.items() if k in RECIPE_KINDS), None)
    if recipe is None:
        return launcher
    sharded = fsdp_plugin is not None or (parallelism_config is not None and not parallelism_config.replicate_only)
    if mixed_precision != "fp8" and not sharded:
        raise ValueError(
            f"kwargs_handlers holds {type(recipe).__name__}, an fp8 recipe handler, but mixed_precision is "
            f"{mixed_precision!r}: an fp8 recipe needs mixed_precision='fp8' (Accelerator(mixed_precision='fp8') "
            "or hasten launch --mixed_precision fp8); drop the handler to train without fp8"
        )
    backend = recipe_backend(recipe)
    if launcher not in (FP8BackendType.NO, backend):
        warnings.warn(
            f"{type(recipe).__name__} in code overrides {env.ACCELERATE_FP8_BACKEND}={launcher.value!r} from the "
            f"launcher; using {backend.value!r}",
            stacklevel=4,  # the user's Accelerator(...) line (fp8_setting <- resolve <- __init__ <- caller)
        )
    return backend


def _setting(name: str, code_value: Any, env_name: str, default: Any, parse: Callable[[str], Any]) -> Any:
    """A setting from code, else the launcher's environment, else the default.

    When both are given and disagree, the code wins, silently where ``hasten launch`` took the
    value from the config file (as Accelerate's code wins over its config file), else (a flag, or
    a variable the user set) with a one-line warning.
    """
    raw = env.get(env_name)
    env_value = parse(raw) if raw not in (None, "") else None
    if code_value is None:
        return default if env_value is None else env_value
    from_file = env_name in (env.get(env.HASTEN_FROM_CONFIG_FILE) or "").split(",")
    if env_value is not None and env_value != code_value and not from_file:
        warnings.warn(
            f"Accelerator({name}={code_value!r}) in code overrides {env_name}={raw!r} from the launcher; "
            f"using {code_value!r}",
            stacklevel=4,  # the user's Accelerator(...) line (_setting <- resolve <- __init__ <- caller)
        )
    return code_value


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
    given = {
        k: x
        for k, x in (("split_batches", split_batches), ("even_batches", even_batches))
        if not isinstance(x, _NotGiven)
    }
    for name, value in given.items():
        v.check_bool("Accelerator", name, value)
    if config is None:
        return DataLoaderConfiguration(
            **{
                k: x.value if isinstance(x, _NotGiven) else x
                for k, x in (("split_batches", split_batches), ("even_batches", even_batches))
            }
        )
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
        raise TypeError(
            f"Accelerator.gradient_accumulation_plugin must be a GradientAccumulationPlugin or None, got {plugin!r}"
        )
    if gradient_accumulation_steps not in (None, 1):
        raise ValueError(
            f"Accelerator got both gradient_accumulation_steps={gradient_accumulation_steps!r} and "
            f"gradient_accumulation_plugin={plugin!r}; pass one (the plugin's num_steps)"
        )
    return plugin


def project_configuration(project_dir: Any, project_config: Any) -> ProjectConfiguration:
    """The Accelerator's ProjectConfiguration from its ``project_dir`` and ``project_config`` arguments."""
    given = _optional_path("Accelerator", "project_dir", project_dir)  # a path, non-empty, or None
    if project_config is None:
        return ProjectConfiguration(project_dir=given)
    if not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"Accelerator.project_config must be a ProjectConfiguration or None, got {project_config!r}")
    if given is not None:
        if project_config.project_dir is None:
            project_config.set_directories(given)
        elif os.path.abspath(given) != os.path.abspath(project_config.project_dir):
            raise ValueError(
                f"Accelerator(project_dir={given!r}) conflicts with ProjectConfiguration(project_dir="
                f"{project_config.project_dir!r}); give the project directory once"
            )
    return project_config


_DEEPSPEED = (
    "DeepSpeed (hasten does not run DeepSpeed; shard with FSDP2 instead: "
    "fsdp_plugin=FullyShardedDataParallelPlugin(), ZeRO-3's counterpart, with reshard_after_forward=False "
    "for ZeRO-2's, or train with DDP, no plugin)"
)

# Accelerator arguments of Accelerate's that hasten has no counterpart for: what each is for.
_ACCELERATE_ONLY = {
    "deepspeed_plugin": _DEEPSPEED,
    "deepspeed_plugins": _DEEPSPEED,
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": (
        "tensor parallelism through Accelerate's TorchTensorParallelPlugin "
        "(hasten's is ParallelismConfig(tp_size=..., tp_plan=...))"
    ),
    "rng_types": (
        "synchronising random generators at each epoch: hasten's shuffling uses one seeded sampler on "
        "every process (set_seed, or DataLoaderConfiguration(data_seed=...)), so the order already agrees "
        "(Accelerate's default, rng_types=['generator'], is what hasten does)"
    ),
}


def accelerate_only(arguments: dict[str, Any]) -> dict[str, Any]:
    """The unexpected arguments left after Accelerate-only ones that ask for nothing (None).

    One that asks for something is a clear error naming what hasten does not do.
    """
    left = {}
    for name, value in arguments.items():
        if name not in _ACCELERATE_ONLY:
            left[name] = value
        elif value is not None:
            raise TypeError(
                f"Accelerator({name}={value!r}) is Accelerate's argument for {_ACCELERATE_ONLY[name]}; hasten does "
                f"not support it (leave {name} out, or pass None). README, 'Coming from Accelerate', lists what is "
                "supported"
            )
    return left


def fsdp_plugin_setting(plugin: Any) -> FullyShardedDataParallelPlugin | None:
    """The plugin given in code, else one built from the launcher's environment when it asks for
    FSDP (HASTEN_USE_FSDP or ACCELERATE_USE_FSDP true; the fields from the FSDP_* variables), else None."""
    if plugin is not None:
        if not isinstance(plugin, FullyShardedDataParallelPlugin):
            raise TypeError(f"Accelerator.fsdp_plugin must be a FullyShardedDataParallelPlugin or None, got {plugin!r}")
        return plugin
    return FullyShardedDataParallelPlugin() if use_fsdp_from_env() else None


def _config_file_handlers() -> dict[type[KwargsHandler], KwargsHandler]:
    """Handlers from the config file named by the launcher (none without one)."""
    if not env.get(env.HASTEN_CONFIG_FILE):
        return {}
    from hasten.settings.config_file import handlers_from_env

    return sort_handlers(handlers_from_env())


@dataclass
class Settings:
    """What an Accelerator is built from, resolved and validated."""

    handlers: dict[type[KwargsHandler], KwargsHandler]
    mixed_precision: str
    gradient_accumulation_steps: int
    accumulation_plugin: GradientAccumulationPlugin | None
    dataloader_config: DataLoaderConfiguration
    project_config: ProjectConfiguration
    dynamo_plugin: TorchDynamoPlugin
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    parallelism_config: Any = None
    fp8_backend: FP8BackendType = FP8BackendType.NO

    def handler(self, kind: type[KwargsHandler]) -> Any:
        return self.handlers.get(kind)

    @property
    def recipe_handler(self) -> KwargsHandler | None:
        """The fp8 recipe handler given (AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs or
        FP8RecipeKwargs), or None."""
        return next((h for k, h in self.handlers.items() if k in RECIPE_KINDS), None)


def resolve(
    *,
    split_batches: Any,
    even_batches: Any,
    mixed_precision: str | None,
    gradient_accumulation_steps: int | None,
    kwargs_handlers: Any,
    dataloader_config: Any,
    project_dir: Any,
    project_config: Any,
    gradient_accumulation_plugin: Any,
    dynamo_backend: Any = None,
    dynamo_plugin: Any = None,
    unexpected: dict[str, Any],
    fsdp_plugin: Any = None,
    parallelism_config: Any = None,
    flags: dict[str, Any],
) -> Settings:
    """The Accelerator's settings from its arguments (``flags``: its plain booleans, checked),
    the launcher's environment and the config file. Raises where a value is wrong."""
    unexpected = accelerate_only(unexpected)
    if unexpected:
        name = next(iter(unexpected))
        close = difflib.get_close_matches(name, _INIT_ARGS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(_INIT_ARGS)}"
        raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}{hint}")
    for flag, value in flags.items():
        v.check_bool("Accelerator", flag, value)
    if mixed_precision is not None:
        mixed_precision = v.check_choice("Accelerator", "mixed_precision", mixed_precision, MIXED_PRECISION_CHOICES)
    if gradient_accumulation_steps is not None:
        v.check_number("Accelerator", "gradient_accumulation_steps", gradient_accumulation_steps, integer=True, ge=1)
    loader_config = dataloader_configuration(split_batches, even_batches, dataloader_config)
    project = project_configuration(project_dir, project_config)
    plugin = accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
    steps_field = "gradient_accumulation_steps"
    if plugin is not None:
        steps_field, gradient_accumulation_steps = "gradient_accumulation_plugin.num_steps", plugin.num_steps
    handlers = sort_handlers(kwargs_handlers)
    handlers = {**_config_file_handlers(), **handlers}  # code wins over the config file
    mp = _setting(
        "mixed_precision",
        mixed_precision,
        env.HASTEN_MIXED_PRECISION,
        "no",
        lambda s: v.check_choice(env.HASTEN_MIXED_PRECISION, "", s.lower(), MIXED_PRECISION_CHOICES),
    )
    steps = _setting(
        steps_field,
        gradient_accumulation_steps,
        env.HASTEN_GRADIENT_ACCUMULATION_STEPS,
        1,
        lambda s: v.parse_positive_int(env.HASTEN_GRADIENT_ACCUMULATION_STEPS, s),
    )
    compile_plugin = dynamo(dynamo_backend, dynamo_plugin)
    fsdp = fsdp_plugin_setting(fsdp_plugin)
    parallelism = parallelism_setting(parallelism_config)
    fsdp, parallelism = fsdp1_strategy(fsdp, parallelism)
    return Settings(
        handlers,
        mp,
        steps,
        plugin,
        loader_config,
        project,
        compile_plugin,
        fsdp,
        parallelism,
        fp8_setting(handlers, mp, fsdp, parallelism),
    )


def fsdp1_strategy(fsdp: FullyShardedDataParallelPlugin | None, parallelism: Any) -> tuple[Any, Any]:
    """The plugin's FSDP1 ``sharding_strategy``, as a config file's runs: NO_SHARD is DDP (no plugin),
    HYBRID_SHARD(_ZERO2) on several machines HSDP (a ParallelismConfig of one replica per machine,
    sharded over its processes) unless a ParallelismConfig is given."""
    if fsdp is None or fsdp.sharding_strategy is None:
        return fsdp, parallelism
    if fsdp.sharding_strategy == "NO_SHARD":
        if parallelism is not None and not parallelism.replicate_only:
            raise ValueError(
                "FullyShardedDataParallelPlugin(sharding_strategy='NO_SHARD') asks not to shard, but the "
                f"ParallelismConfig given shards ({parallelism!r}): drop one of them"
            )
        return None, parallelism
    if parallelism is None:
        dims = fsdp.hybrid_dims(env.env_int(env.WORLD_SIZE, 1), env.env_int(env.LOCAL_WORLD_SIZE, 1))
        if dims is not None:
            from hasten.settings.parallelism import ParallelismConfig

            parallelism = ParallelismConfig(dp_replicate_size=dims[0], dp_shard_size=dims[1])
    return fsdp, parallelism


def parallelism_setting(config: Any) -> Any:
    """The ParallelismConfig given in code, else one from the launcher's environment
    (``hasten launch --use_parallelism_config``: ACCELERATE_USE_PARALLELISM_CONFIG true), else None."""
    from hasten.settings.parallelism import ParallelismConfig

    if config is None:
        return ParallelismConfig.from_env()
    if not isinstance(config, ParallelismConfig):
        raise TypeError(f"Accelerator.parallelism_config must be a ParallelismConfig or None, got {config!r}")
    return config


def dynamo(backend: Any, plugin: Any) -> TorchDynamoPlugin:
    """The Accelerator's TorchDynamoPlugin: the one given, or built from ``dynamo_backend``, or
    from the launcher's environment (``hasten launch --dynamo_backend ...``); not both."""
    if plugin is not None and backend is not None:
        raise ValueError(
            f"Accelerator got dynamo_backend={backend!r} and dynamo_plugin={plugin!r}; pass one "
            "(the plugin's backend field)"
        )
    if plugin is not None:
        if not isinstance(plugin, TorchDynamoPlugin):
            raise TypeError(f"Accelerator.dynamo_plugin must be a TorchDynamoPlugin or None, got {plugin!r}")
        return plugin
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"Accelerator.dynamo_backend must be a backend name (str or DynamoBackend), got {backend!r}")
    return TorchDynamoPlugin(backend=backend)
