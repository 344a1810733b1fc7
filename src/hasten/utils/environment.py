"""``accelerate.utils.environment``: set or clear environment variables for a block, read them
as Accelerate's helpers do, and the machine's facts (``get_cpu_distributed_information``,
``get_current_device_type``, ``get_gpu_info``, ``check_cuda_fp8_capability``).

Every read and write goes through ``hasten.settings.environment`` (the one module of hasten that
touches ``os.environ``). Pure Python: no torch at import (``check_cuda_fp8_capability`` imports it
where ``nvidia-smi`` cannot answer).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env

__all__ = [
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "get_current_device_type",
    "get_gpu_info",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def _variable(owner: str, key: Any, value: Any) -> tuple[str, str]:
    """``(KEY, str(value))`` for ``os.environ``, or an error naming what the environment cannot hold."""
    if not isinstance(key, str) or not key or "=" in key or "\0" in key:
        raise ValueError(
            f"{owner}: {v.shown(key)} cannot be an environment variable's name (a non-empty string without '=' or NUL)"
        )
    text = str(value)
    if "\0" in text:
        raise ValueError(f"{owner}: the value of {key.upper()} holds a NUL character, which the environment cannot")
    return key.upper(), text


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable for the ``with`` block (the name upper-cased,
    the value as ``str(value)``), then restore each: its old value, or unset if it was unset.

    As Accelerate's. Every name and value is checked before any is set: a refused call sets nothing.
    """
    values = dict(_variable("patch_environment", key, value) for key, value in kwargs.items())
    with env.patched(values):
        yield


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Empty the environment for the ``with`` block; afterwards it holds exactly what it held before
    (what the block set is dropped, what it changed or unset is restored). As Accelerate's."""
    with env.cleared():
        yield


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 for y, yes, t, true, on, 1 and 0 for n, no, f, false, off, 0 (any case); True/False with
    ``to_bool``. Other text is a ValueError naming it and the spellings."""
    if not isinstance(value, str):
        raise TypeError(f"str_to_bool.value must be a string, got {v.shown(value)} ({type(value).__name__})")
    lowered = value.lower()
    if lowered not in _TRUE + _FALSE:
        raise ValueError(f"invalid truth value {value!r}: one of {', '.join(_TRUE)} or {', '.join(_FALSE)} (any case)")
    result = lowered in _TRUE
    return result if to_bool else int(result)


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """The first of these variables that holds an integer >= 0, else ``default`` (as Accelerate's:
    a variable set to text that is not an integer is a ValueError naming it)."""
    for key in env_keys:
        raw = env.get(key)
        value = -1 if raw is None else v.parse_int_text(f"environment variable {key}", raw)
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether variable ``key`` is set to a true spelling (see ``str_to_bool``); ``default`` when unset."""
    return str_to_bool(env.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Variable ``key``'s text, ``str(default)`` when unset."""
    return env.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` that are imported in this process (in ``sys.modules``)."""
    return [name for name in library_names if name in sys.modules]


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=value\\n`` lines (for an env file) of the items whose key and value are not empty and
    hold none of ``; \\n < >`` or a space; each item left out is logged as a warning."""
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            from hasten.logging import get_logger

            get_logger(__name__).warning(
                f"WARNING: Skipping {key}={value} as it contains forbidden characters or missing values."
            )
    return lines


#: the variables ``purge_accelerate_environment`` keeps as they were: Accelerate's, and hasten's own
_PURGED = ("ACCELERATE_", env.PREFIX)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator: after the function (or each ``test*`` method of the class and its subclasses),
    the ``ACCELERATE_*`` variables (and hasten's ``HASTEN_*``) are as they were before the call
    (for tests: ``TrainingArguments(fp16=True)`` exports ``ACCELERATE_MIXED_PRECISION``)."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with env.kept(_PURGED):
                return func(*args, **kwargs)

        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        v.check_callable("purge_accelerate_environment", "func_or_cls", func_or_cls, optional=False)
        return wrap(func_or_cls)

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method):
                if not hasattr(method, "_accelerate_is_purged_environment_wrapped"):
                    setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kw: wrap_tests(cls))  # type: ignore[assignment]
    return func_or_cls


# ----------------------------------------------------------------------------- the machine
@dataclass
class CPUInformation:
    """This process's place in a CPU run: ``rank``, ``world_size``, ``local_rank``, ``local_world_size``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """This process's ranks from the launcher's variables (torch's, else MPI's: Intel MPI, Open
    MPI, MVAPICH), as Accelerate reads them; one process where none is set."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(
            ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0
        ),
        local_world_size=get_int_from_env(
            ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], 1
        ),
    )


def get_current_device_type() -> tuple[str, str]:
    """``(device type, distributed type)`` of this machine's accelerator without initialising it,
    in Accelerate's order (MLU, SDAA, MUSA, NPU, HPU, XPU, Neuron), else ``("cuda", "MULTI_GPU")``
    (also on a machine without any, as Accelerate answers). hasten itself runs on CPU and CUDA."""
    from hasten.utils import imports

    for device, distributed in (
        ("mlu", "MULTI_MLU"),
        ("sdaa", "MULTI_SDAA"),
        ("musa", "MULTI_MUSA"),
        ("npu", "MULTI_NPU"),
        ("hpu", "MULTI_HPU"),
        ("xpu", "MULTI_XPU"),
        ("neuron", "MULTI_NEURON"),
    ):
        if getattr(imports, f"is_{device}_available")():
            return device, distributed
    return "cuda", "MULTI_GPU"


def _nvidia_smi() -> str:
    """``nvidia-smi``'s command (on Windows where the driver installs it)."""
    if sys.platform == "win32":
        found = os.path.join(env.get("SYSTEMDRIVE", "C:"), "Program Files", "NVIDIA Corporation", "NVSMI")
        return os.path.join(found, "nvidia-smi.exe") if os.path.isdir(found) else "nvidia-smi.exe"
    return "nvidia-smi"


def get_gpu_info() -> tuple[list[str], int]:
    """``(names, count)`` of the NVIDIA GPUs, from ``nvidia-smi`` (CUDA is not initialised); an
    error (``FileNotFoundError``, ``CalledProcessError``) where it cannot run, as in Accelerate."""
    output = subprocess.check_output(
        [_nvidia_smi(), "--query-gpu=count,name", "--format=csv,noheader"], universal_newlines=True
    ).strip()
    gpus = output.split(os.linesep)
    return [gpu.split(",")[1].strip() for gpu in gpus], len(gpus)


def check_cuda_fp8_capability() -> bool:
    """Whether the first GPU multiplies in fp8 (compute capability 8.9 or newer), from
    ``nvidia-smi``, else from torch (which initialises CUDA; an error where there is none)."""
    try:
        output = subprocess.check_output(
            [_nvidia_smi(), "--query-gpu=compute_capability", "--format=csv,noheader"], universal_newlines=True
        )
        capability = tuple(map(int, output.strip().split(os.linesep)[0].split(".")))
    except Exception:
        import torch

        capability = torch.cuda.get_device_capability()
    return capability >= (8, 9)
