"""``accelerate.utils.other``: process-aware ``save``/``load``/``wait_for_everyone``,
``write_basic_config``, the kernel check and small helpers.

``save`` writes through hasten's checkpoint writer (``hasten.checkpoint.model_files.save``: a path
is replaced atomically; safetensors store tied weights once); ``load`` reads through torch's
``weights_only`` allow-list, as hasten reads checkpoints, so nothing a file names is run.
Heavy imports (torch, the checkpoint package, PyYAML) wait for the call that needs them. The model
helpers (``clean_state_dict_for_safetensors``, ``get_module_children_bottom_up``,
``compile_regions_fsdp2``, ``compile_regions_deepspeed``) are here too.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import platform
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hasten import _validate as v
from hasten.logging import get_logger
from hasten.settings import environment as env

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "convert_bytes",
    "get_module_children_bottom_up",
    "get_model_tp_size",
    "get_pretty_name",
    "is_port_in_use",
    "load",
    "merge_dicts",
    "recursive_getattr",
    "save",
    "wait_for_everyone",
    "write_basic_config",
]

MIN_LINUX_KERNEL = (5, 5, 0)
logger = logging.getLogger(__name__)

# Accelerate's names of this module that hasten.utils.modeling defines (on the strategies and the
# compile module), loaded on first use: the Accelerator imports this module for check_os_kernel.
_FROM_MODELING = (
    "compile_regions",
    "extract_model_from_parallel",
    "has_compiled_regions",
    "is_compiled_module",
    "model_has_dtensor",
)
__all__ += _FROM_MODELING


def __getattr__(name: str) -> Any:
    if name in _FROM_MODELING:
        from hasten.utils import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_os_kernel() -> None:
    """Warn (through the ``hasten`` logger, main process) when the Linux kernel is older than 5.5,
    where processes of a distributed run can hang (as Accelerate warns). Other systems: nothing."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if match is None:
        return
    version = tuple(int(x) for x in match.groups())
    if version < MIN_LINUX_KERNEL:
        found, least = ".".join(map(str, version)), ".".join(map(str, MIN_LINUX_KERNEL))
        get_logger("hasten").warning(
            f"Detected kernel version {found}, which is below the recommended minimum of {least}; processes of a "
            "distributed run can hang on it. Upgrade the kernel to this version or later.",
            main_process_only=True,
        )


# ----------------------------------------------------------------------------- processes


class _ThisProcess:
    """Where this process stands, as Accelerate's ``PartialState()`` would say: from the process
    group where there is one; else, under a launcher of several processes, from a ``ProcessState``
    (which joins the group, as ``PartialState()`` does); else a single process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.several = dist.get_world_size() > 1
            self.is_main_process = dist.get_rank() == 0
            self.is_local_main_process = env.env_int(env.LOCAL_RANK, 0) == 0
        elif env.env_int(env.WORLD_SIZE, 1) > 1:
            from hasten.distributed.state import ProcessState

            state = ProcessState()
            self.several = state.use_distributed
            self.is_main_process = state.is_main_process
            self.is_local_main_process = state.is_local_main_process
        else:
            self.several = False
            self.is_main_process = self.is_local_main_process = True
        self.save_on_each_node = False

    def writes_here(self) -> bool:
        """Whether ``save`` writes on this process (what hasten's checkpoint writer asks)."""
        return self.is_local_main_process if self.save_on_each_node else self.is_main_process


def wait_for_everyone() -> None:
    """Block until every process reaches this call (``torch.distributed.barrier``); nothing on one
    process. Every process must call it, or the others wait until the group's timeout."""
    if _ThisProcess().several:
        import torch.distributed as dist

        dist.barrier()


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """``torch.save(obj, f)`` on the main process only (each machine's local main process with
    ``save_on_each_node``); with ``safe_serialization`` ``obj`` must be a dict of tensors, written
    as safetensors (tied weights stored once). A path is replaced atomically. As Accelerate's."""
    v.check_bool("save", "save_on_each_node", save_on_each_node)
    v.check_bool("save", "safe_serialization", safe_serialization)
    from hasten.checkpoint.model_files import save as write

    here = _ThisProcess()
    here.save_on_each_node = save_on_each_node
    write(here, obj, f, safe_serialization)  # type: ignore[arg-type]  # it asks only for writes_here()


_LOAD_HINT = "; load(f, weights_only=False) reads a file you trust that holds other objects"


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, map_location=map_location, **kwargs)`` with ``weights_only=True`` unless
    given: tensors, plain containers and the NumPy arrays of a random state are read; a file that
    names any other class or function is refused (``UnsafeCheckpoint``), naming it, and nothing of
    it runs. As Accelerate's (which also allows those NumPy types). ``f`` may be a URL of an
    installed fsspec protocol (as ``save`` writes them); no password written in it is shown."""
    from hasten.checkpoint.errors import secrets_hidden

    with secrets_hidden(f if isinstance(f, str) else None):
        return _load(f, map_location, **kwargs)


def _load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``load``, its secrets not yet hidden."""
    import torch

    weights_only = v.check_bool("load", "weights_only", kwargs.pop("weights_only", True))
    if isinstance(f, (str, os.PathLike)):  # a path or a URL, as save writes them (a typo of a URL refused)
        from hasten.checkpoint import storage

        f = storage.check_location("load", "f", f)
        if storage.is_url(f) and (kwargs or not weights_only):  # torch.load takes no URL: the object's bytes
            import io

            f = io.BytesIO(storage.read_bytes(f))
    if not weights_only:
        return torch.load(f, map_location=map_location, weights_only=False, **kwargs)
    try:
        from hasten.checkpoint.layouts.names import rng_types

        allowed = rng_types()
    except ImportError:  # no NumPy: nothing of it to allow
        allowed = []
    from hasten.checkpoint.unpickle import torch_load

    with torch.serialization.safe_globals(allowed):
        if kwargs:  # torch.load's other options (mmap, ...): torch's own errors
            return torch.load(f, map_location=map_location, weights_only=True, **kwargs)
        return torch_load(f, f"load({v.shown(f)})", True, _LOAD_HINT, map_location)


# ----------------------------------------------------------------------------- config file


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike | None = None) -> Path | bool:
    """Write a config file for ``hasten launch`` with one process per visible CUDA GPU (one CPU
    process without GPUs) and ``mixed_precision``; return its path. As Accelerate's, an existing
    file is left as it is: a message says so and False is returned.

    ``save_location``: the file (default: ``hasten config``'s, ``$HASTEN_CONFIG_HOME/default_config.yaml``
    or ``~/.cache/hasten/default_config.yaml``). The file is hasten's YAML (needs PyYAML), or JSON
    when its name ends in ``.json`` (as Accelerate's, which writes JSON); ``hasten launch
    --config_file`` reads both (JSON is YAML).
    """
    from hasten.settings.choices import MIXED_PRECISION_CHOICES
    from hasten.settings.config_file import default_config_path, write_config

    if not isinstance(mixed_precision, str):
        raise TypeError(
            f"write_basic_config.mixed_precision must be one of {', '.join(map(repr, MIXED_PRECISION_CHOICES))}, "
            f"got {v.shown(mixed_precision)} ({type(mixed_precision).__name__})"
        )
    mixed_precision = v.check_choice(
        "write_basic_config", "mixed_precision", str(mixed_precision).lower(), MIXED_PRECISION_CHOICES
    )
    if save_location is not None and not isinstance(save_location, (str, os.PathLike)):
        raise TypeError(f"write_basic_config.save_location must be a path or None, got {v.shown(save_location)}")
    if save_location is not None:  # hasten launch reads its config file from the local disk: a URL is refused
        from hasten.checkpoint.files import check_path

        check_path("write_basic_config", "save_location", os.path.expanduser(os.fspath(save_location)))
    path = Path(save_location).expanduser() if save_location is not None else default_config_path()
    if path.exists():
        print(
            f"Configuration already exists at {path}, will not override. Run `hasten config` manually or pass a "
            "different `save_location`."
        )
        return False
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    settings = {"num_processes": max(gpus, 1), "cpu": gpus == 0, "mixed_precision": mixed_precision}
    if path.suffix.lower() == ".json":
        return _write_json(path, settings)
    return write_config(path, settings)


def _write_json(path: Path, settings: dict[str, Any]) -> Path:
    """``settings`` as a JSON object in ``path``, replaced atomically (its folder made if missing)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- small helpers


def get_pretty_name(obj: Any) -> str:
    """``obj``'s qualified name, else its class's, else ``str(obj)``."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return obj.__qualname__
    if hasattr(obj, "__name__"):
        return obj.__name__
    return str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` (nested dicts merged key by key); returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``port`` (default 29500) of localhost."""
    port = 29500 if port is None else v.check_number("is_port_in_use", "port", port, integer=True, ge=1, le=65535)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", port)) == 0


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit below 1024 of it: ``"1.5 KB"``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer")``."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_model_tp_size(model: Any) -> int | None:
    """The tensor-parallel degree a ``transformers`` model was sharded with (``model.tp_size``, or
    its config's ``distributed_config``'s ``tp_size`` in transformers 5), else None."""
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        return distributed_config.get("tp_size")
    return getattr(distributed_config, "tp_size", None)


# ----------------------------------------------------------------------------- models
def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict safetensors can store, as Accelerate's: of names sharing one storage (tied
    weights) only the first is kept (the others are deleted from ``state_dict`` itself, with a
    warning), and every tensor made contiguous."""
    import torch

    from hasten.utils.modeling import id_tensor_storage

    by_storage: dict[Any, list[str]] = collections.defaultdict(list)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, str):  # bitsandbytes' serialized weights can be strings
            by_storage[id_tensor_storage(tensor)].append(name)
    removed = {name for names in by_storage.values() for name in names[1:]}
    for name in removed:
        del state_dict[name]
    if removed:
        logger.warning(
            f"Removed shared tensor {removed} while saving. This should be OK, but check by verifying that you don't "
            "receive any warning while reloading"
        )
    return {k: t.contiguous() if isinstance(t, torch.Tensor) else t for k, t in state_dict.items()}


def get_module_children_bottom_up(
    model: torch.nn.Module, return_fqns: bool = False
) -> list[torch.nn.Module] | list[tuple[str, torch.nn.Module]]:
    """Every module of ``model``, children before their parents and ``model`` last (with
    ``return_fqns``, ``(name, module)`` pairs, ``""`` for the model), in Accelerate's order: a
    depth-first walk that takes the last child first, reversed."""
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    ordered: list[tuple[str, torch.nn.Module]] = []
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            if child is not None:
                stack.append((f"{name}.{child_name}" if name else child_name, child))
        ordered.append((name, module))
    ordered.reverse()
    return ordered if return_fqns else [m for _, m in ordered]


def _compile_in_place(module: torch.nn.Module, compile_kwargs: dict[str, Any]) -> None:
    """Each repeated block of ``module`` compiled in place (``nn.Module.compile``), each other
    part beside them too; without repeated blocks, ``module`` itself."""
    from hasten.training.compile import repeated_blocks

    blocks = {id(b) for b in repeated_blocks(module)}

    def visit(m: torch.nn.Module) -> None:
        if id(m) in blocks or not any(id(s) in blocks for s in m.modules()):
            m.compile(**compile_kwargs)
        else:
            for child in m.children():
                visit(child)

    visit(module)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Regional compilation in place (``module.compile()`` on each repeated block and on each
    other part), for a model ``fully_shard`` wraps after: its hooks still run, as they would not
    around ``torch.compile``'s wrapper. Returns ``module``."""
    _compile_in_place(module, compile_kwargs)
    return module


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place, as ``compile_regions_fsdp2`` (Accelerate's for a DeepSpeed
    engine's module; it needs no DeepSpeed and works on any module). Returns None, as Accelerate's."""
    _compile_in_place(module, compile_kwargs)
