"""Accelerate's ``is_*_available`` helpers (``accelerate.utils.imports``): what this machine has.

Each answers for the machine the script runs on: a package is available when Python can find
it (``importlib.util.find_spec``: the package is not imported), a device when torch says so.
This module itself imports neither torch nor any of the packages it asks about. hasten itself trains on the CPU and
CUDA: an accelerator these report (NPU,
XPU, ...) is there, but hasten does not place models on it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable
from functools import cache, wraps
from typing import Any

__all__ = [  # Accelerate 1.15's, in its order, and 1.16's device backend helpers
    "get_torch_accelerator_backend",
    "get_distributed_backend",
    "is_torch_distributed_available",
    "is_xccl_available",
    "is_import_timer_available",
    "is_pynvml_available",
    "is_amdsmi_available",
    "is_rocm_available",
    "is_pytest_available",
    "is_msamp_available",
    "is_schedulefree_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_lomo_available",
    "is_cuda_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_deepspeed_available",
    "is_pippy_available",
    "is_bf16_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_bnb_available",
    "is_bitsandbytes_multi_backend_available",
    "is_torchvision_available",
    "is_megatron_lm_available",
    "is_transformers_available",
    "is_datasets_available",
    "is_peft_available",
    "is_timm_available",
    "is_triton_available",
    "is_aim_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "is_comet_ml_available",
    "is_swanlab_available",
    "is_trackio_available",
    "is_boto3_available",
    "is_rich_available",
    "is_sagemaker_available",
    "is_tqdm_available",
    "is_clearml_available",
    "is_pandas_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_mlu_available",
    "is_musa_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_hpu_available",
    "is_xpu_available",
    "is_neuron_available",
    "is_dvclive_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_weights_only_available",
    "is_numpy_available",
]
# Accelerate's decorators of this module (not is_*_available helpers)
__all__ += ["deepspeed_required", "torchao_required"]


@cache
def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken spec
        return False


def _version(distribution: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])


def _at_least(distribution: str, minimum: str | None) -> bool:
    if minimum is None:
        return True
    found = _version(distribution)
    return found is not None and found >= tuple(int(n) for n in re.findall(r"\d+", minimum)[:3])


def _torch():  # type: ignore[no-untyped-def]
    import torch

    return torch


def _device(backend: str, package: str | None, check_device: bool) -> bool:
    """A torch device backend (``torch.<backend>``) that a plug-in package provides."""
    if package is not None and not _found(package):
        return False
    torch = _torch()
    if package is not None:
        try:
            importlib.import_module(package)  # registers the backend with torch
        except Exception:  # noqa: BLE001 - a plug-in that fails to load is not available
            return False
    module = getattr(torch, backend, None)
    available = module is not None and hasattr(module, "is_available") and module.is_available()
    if available and check_device:
        return module.device_count() > 0
    return bool(available)


# ---------------------------------------------------------------------------- packages
def is_import_timer_available() -> bool:
    return _found("import_timer")


def is_pynvml_available() -> bool:
    return _found("pynvml")


def is_amdsmi_available() -> bool:
    return _found("amdsmi")


def is_pytest_available() -> bool:
    return _found("pytest")


def is_msamp_available() -> bool:
    return _found("msamp")


def is_schedulefree_available() -> bool:
    return _found("schedulefree")


def is_transformer_engine_available() -> bool:
    return _found("transformer_engine") or _found("intel_transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Transformer Engine's MXFP8 needs the package and a CUDA device of compute capability 10+."""
    if not is_transformer_engine_available() or not is_cuda_available():
        return False
    return _torch().cuda.get_device_capability()[0] >= 10


def is_lomo_available() -> bool:
    return _found("lomo_optim")


def is_torchao_available() -> bool:
    return _found("torchao")


def is_deepspeed_available() -> bool:
    return _found("deepspeed")


def is_torchvision_available() -> bool:
    return _found("torchvision")


def is_megatron_lm_available() -> bool:
    return _found("megatron") and _found("megatron.core")


def is_transformers_available() -> bool:
    return _found("transformers")


def is_datasets_available() -> bool:
    return _found("datasets")


def is_peft_available() -> bool:
    return _found("peft")


def is_timm_available() -> bool:
    return _found("timm")


def is_triton_available() -> bool:
    return _found("triton")


def is_aim_available() -> bool:
    return _found("aim")


def is_tensorboard_available() -> bool:
    return _found("tensorboard") or _found("tensorboardX")


def is_wandb_available() -> bool:
    return _found("wandb")


def is_comet_ml_available() -> bool:
    return _found("comet_ml")


def is_swanlab_available() -> bool:
    return _found("swanlab")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and _found("trackio")


def is_boto3_available() -> bool:
    return _found("boto3")


def is_rich_available() -> bool:
    return _found("rich")


def is_sagemaker_available() -> bool:
    return _found("sagemaker")


def is_tqdm_available() -> bool:
    return _found("tqdm")


def is_clearml_available() -> bool:
    return _found("clearml")


def is_pandas_available() -> bool:
    return _found("pandas")


def is_matplotlib_available() -> bool:
    return _found("matplotlib")


def is_mlflow_available() -> bool:
    return _found("mlflow")


def is_dvclive_available() -> bool:
    return _found("dvclive")


def is_torchdata_available() -> bool:
    return _found("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _found("torchdata") and _found("torchdata.stateful_dataloader")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    return _found("numpy") and _at_least("numpy", min_version)


def is_bnb_available(min_version: str | None = None) -> bool:
    return _found("bitsandbytes") and _at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


# ---------------------------------------------------------------------------- torch
def is_torch_distributed_available() -> bool:
    return _torch().distributed.is_available()


def is_xccl_available() -> bool:
    dist = _torch().distributed
    return dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)()


def is_rocm_available() -> bool:
    return _torch().version.hip is not None


def is_cuda_available() -> bool:
    return _torch().cuda.is_available()


def is_pippy_available() -> bool:
    """Pipeline parallelism (``torch.distributed.pipelining``, in torch since 2.4)."""
    return _found("torch.distributed.pipelining")


def is_weights_only_available() -> bool:
    """``torch.load(weights_only=True)`` (torch 2.11 and newer, which hasten needs)."""
    return True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 works here: on the CPU always, on CUDA where the device supports it."""
    torch = _torch()
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    return True  # the CPU and CUDA both run fp16 (hasten with a GradScaler on the CPU too)


def is_fp8_available() -> bool:
    """A package that provides fp8 training: torchao (any machine), TransformerEngine or MS-AMP."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    if not _found("torch_xla"):
        return False
    if check_is_tpu or check_is_gpu:
        try:
            import torch_xla.runtime as xr
        except Exception:  # noqa: BLE001 - an XLA install that cannot start has no device
            return False
        kind = xr.device_type()
        return (not check_is_tpu or kind == "TPU") and (not check_is_gpu or kind in ("GPU", "CUDA"))
    return True


def is_mps_available(min_version: str = "1.12") -> bool:
    torch = _torch()
    return _at_least("torch", min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_mlu_available(check_device: bool = False) -> bool:
    return _device("mlu", "torch_mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    return _device("musa", "torch_musa", check_device)


def is_npu_available(check_device: bool = False) -> bool:
    return _device("npu", "torch_npu", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    return _device("sdaa", "torch_sdaa", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    return _found("habana_frameworks") and _device("hpu", "habana_frameworks.torch", False)


def is_xpu_available(check_device: bool = False) -> bool:
    return _device("xpu", None, check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    return _device("neuron", "torch_neuronx", check_device)


# ----------------------------------------------------------------------------- the device backend
#: the device types whose own torch module (``torch.cuda``, ``torch.xpu``, ...) serves them
_NATIVE_MODULES = ("cuda", "mps", "mlu", "sdaa", "musa", "npu", "hpu", "xpu", "neuron")
#: a device type's default distributed backend (Accelerate's ``TORCH_DISTRIBUTED_BACKENDS``)
TORCH_DISTRIBUTED_BACKENDS = {
    "cuda": "nccl",
    "mlu": "cncl",
    "sdaa": "tccl",
    "musa": "mccl",
    "npu": "hccl",
    "hpu": "hccl",
    "xpu": "xccl",
    "neuron": "neuron",
}


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, Any]:
    """This machine's accelerator as ``(device type, its torch API module)``, e.g. ``("cuda", torch.cuda)``;
    ``(None, None)`` where there is none (a CPU-only machine). As Accelerate 1.16's: the type comes from
    ``torch.accelerator.current_accelerator()``; a backend without a module of its own answers with
    ``torch.accelerator``; ``check_available=False`` names the backend without asking whether a device
    answers (e.g. before forking)."""
    torch = _torch()
    try:
        device = torch.accelerator.current_accelerator()
    except RuntimeError as error:  # torch builds without an accelerator may raise instead of answering None
        if "Cannot access accelerator device when none is available" not in str(error):
            raise
        device = None
    if device is not None:
        checks = {
            "cuda": is_cuda_available,
            "mps": is_mps_available,
            "mlu": is_mlu_available,
            "sdaa": is_sdaa_available,
            "musa": is_musa_available,
            "npu": is_npu_available,
            "hpu": is_hpu_available,
            "xpu": is_xpu_available,
            "neuron": is_neuron_available,
        }
        if not check_available or checks.get(device.type, torch.accelerator.is_available)():
            if device.type in _NATIVE_MODULES:
                return device.type, torch.get_device_module(device.type)
            return device.type, torch.accelerator
    if is_hpu_available():  # plug-ins that register themselves with torch late
        return "hpu", torch.hpu
    if is_neuron_available():
        return "neuron", torch.neuron
    return None, None


def get_distributed_backend(device_type: str | None) -> str | None:
    """The default ``torch.distributed`` backend of a device type ("cuda" -> "nccl", ...), None where it
    has none here (the CPU, or "xpu" without XCCL): Accelerate 1.16's."""
    if device_type == "xpu" and not is_xccl_available():
        return None
    return TORCH_DISTRIBUTED_BACKENDS.get(device_type)


# ----------------------------------------------------------------------------- decorators
def torchao_required(func: Callable) -> Callable:
    """Decorator: the function raises an ImportError, naming the pip command, where torchao is
    not installed (as Accelerate's)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(
                f"{func.__qualname__} needs torchao, which is not installed: pip install 'hasten[fp8]' (torchao)"
            )
        return func(*args, **kwargs)

    return wrapper


def deepspeed_required(func: Callable) -> Callable:
    """Decorator: the function refuses to run once an Accelerator exists, since hasten never runs
    DeepSpeed (Accelerate's refuses unless its Accelerator runs DeepSpeed); before any Accelerator
    exists it runs, as in Accelerate."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from hasten.distributed.state import current_run

        if current_run() is not None:
            from hasten.utils.deepspeed import INSTEAD

            raise ValueError(
                f"{func.__qualname__} needs DeepSpeed enabled on the Accelerator, and hasten does not run DeepSpeed; "
                f"{INSTEAD}"
            )
        return func(*args, **kwargs)

    return wrapper


def _document_probes() -> None:
    """A docstring for each ``is_*_available`` probe that has none (they share one meaning)."""
    for name, probe in list(globals().items()):
        if name.startswith("is_") and name.endswith("_available") and callable(probe) and not probe.__doc__:
            what = name[3 : -len("_available")].replace("_", " ")
            probe.__doc__ = (
                f"Accelerate's ``{name}()``: whether {what} can be used here (its package installed, or its "
                "device or library present), answered without raising."
            )


_document_probes()
