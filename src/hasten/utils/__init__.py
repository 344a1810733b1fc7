"""Compatibility re-exports, so ``from hasten.utils import ProfileKwargs`` works as in Accelerate.

The submodules are Accelerate's (``dataclasses``, ``operations``, ``memory``, ``random``,
``other``, ``imports``, ``constants``, ``environment``, ``versions``, ``tqdm``, ``modeling``,
``offload``, ``fsdp_utils``, ``ao``, ``transformer_engine``, ``launch``, ``megatron_lm``), each with
the names of Accelerate's that hasten has. Those of the modules not imported here load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from hasten.settings.parallelism import ParallelismConfig
from hasten.tracking import GeneralTracker
from hasten.utils import constants, dataclasses, environment, memory, operations, random
from hasten.utils.constants import *  # noqa: F403 - each submodule's __all__, as in Accelerate's utils
from hasten.utils.dataclasses import *  # noqa: F403
from hasten.utils.environment import *  # noqa: F403
from hasten.utils.memory import *  # noqa: F403
from hasten.utils.operations import *  # noqa: F403
from hasten.utils.random import *  # noqa: F403

# The function, imported here so that it (not the submodule of the same name) is hasten.utils.tqdm.
from hasten.utils.tqdm import tqdm

_EAGER = [
    *constants.__all__,
    *dataclasses.__all__,
    *environment.__all__,
    *memory.__all__,
    *operations.__all__,
    *random.__all__,
    "tqdm",
]

# Loaded on first use, as in ``hasten`` itself.
_LAZY = {
    # hasten.utils.other's names (its save/load/write_basic_config import their machinery when called)
    "check_os_kernel": "hasten.utils.other",
    "convert_bytes": "hasten.utils.other",
    "get_model_tp_size": "hasten.utils.other",
    "get_pretty_name": "hasten.utils.other",
    "is_port_in_use": "hasten.utils.other",
    "load": "hasten.utils.other",
    "merge_dicts": "hasten.utils.other",
    "recursive_getattr": "hasten.utils.other",
    "save": "hasten.utils.other",
    "wait_for_everyone": "hasten.utils.other",
    "write_basic_config": "hasten.utils.other",
    # defined in hasten.utils.modeling; Accelerate's home for them is accelerate.utils.other
    "compile_regions": "hasten.utils.other",
    "extract_model_from_parallel": "hasten.utils.other",
    "has_compiled_regions": "hasten.utils.other",
    "is_compiled_module": "hasten.utils.other",
    "model_has_dtensor": "hasten.utils.other",
    "clean_state_dict_for_safetensors": "hasten.utils.other",
    "compile_regions_deepspeed": "hasten.utils.other",
    "compile_regions_fsdp2": "hasten.utils.other",
    "get_module_children_bottom_up": "hasten.utils.other",
    # FSDP's files and folders as Accelerate writes them (they import the checkpoint machinery)
    "save_fsdp_model": "hasten.utils.fsdp_utils",
    "load_fsdp_model": "hasten.utils.fsdp_utils",
    "save_fsdp_optimizer": "hasten.utils.fsdp_utils",
    "load_fsdp_optimizer": "hasten.utils.fsdp_utils",
    "merge_fsdp_weights": "hasten.utils.fsdp_utils",
    "disable_fsdp_ram_efficient_loading": "hasten.utils.fsdp_utils",
    "enable_fsdp_ram_efficient_loading": "hasten.utils.fsdp_utils",
    "ensure_weights_retied": "hasten.utils.fsdp_utils",
    "fsdp2_apply_ac": "hasten.utils.fsdp_utils",
    "fsdp2_canonicalize_names": "hasten.utils.fsdp_utils",
    "fsdp2_load_full_state_dict": "hasten.utils.fsdp_utils",
    "fsdp2_prepare_model": "hasten.utils.fsdp_utils",
    "fsdp2_switch_optimizer_parameters": "hasten.utils.fsdp_utils",
    "get_fsdp2_grad_scaler": "hasten.utils.fsdp_utils",
    # accelerate.utils.modeling's model helpers (hasten.utils.modeling)
    "calculate_maximum_sizes": "hasten.utils.modeling",
    "check_tied_parameters_in_config": "hasten.utils.modeling",
    "compute_module_sizes": "hasten.utils.modeling",
    "convert_file_size_to_int": "hasten.utils.modeling",
    "dtype_byte_size": "hasten.utils.modeling",
    "find_tied_parameters": "hasten.utils.modeling",
    "get_grad_scaler": "hasten.utils.modeling",
    "get_max_layer_size": "hasten.utils.modeling",
    "get_accelerator_free_memory": "hasten.utils.modeling",
    "normalize_device": "hasten.utils.modeling",
    "get_mixed_precision_context_manager": "hasten.utils.modeling",
    "id_tensor_storage": "hasten.utils.modeling",
    "is_peft_model": "hasten.utils.modeling",
    "load_checkpoint_in_model": "hasten.utils.modeling",
    "load_state_dict": "hasten.utils.modeling",
    "named_module_tensors": "hasten.utils.modeling",
    "retie_parameters": "hasten.utils.modeling",
    "set_module_tensor_to_device": "hasten.utils.modeling",
    # big-model loading (hasten.big_model): device maps, dispatch hooks, offload
    "align_module_device": "hasten.utils.modeling",
    "check_tied_parameters_on_same_device": "hasten.utils.modeling",
    "clean_device_map": "hasten.utils.modeling",
    "has_offloaded_params": "hasten.utils.modeling",
    "OffloadedWeightsLoader": "hasten.utils.offload",
    "check_device_map": "hasten.utils.modeling",
    "get_balanced_memory": "hasten.utils.modeling",
    "get_max_memory": "hasten.utils.modeling",
    "infer_auto_device_map": "hasten.utils.modeling",
    "load_offloaded_weights": "hasten.utils.modeling",
    "load_offloaded_weight": "hasten.utils.offload",
    "offload_state_dict": "hasten.utils.offload",
    "offload_weight": "hasten.utils.offload",
    "save_offload_index": "hasten.utils.offload",
    # DeepSpeed's helper classes: importable (transformers imports them), refused when made
    "DeepSpeedEngineWrapper": "hasten.utils.deepspeed",
    "DeepSpeedOptimizerWrapper": "hasten.utils.deepspeed",
    "DeepSpeedSchedulerWrapper": "hasten.utils.deepspeed",
    "DummyOptim": "hasten.utils.deepspeed",
    "DummyScheduler": "hasten.utils.deepspeed",
    "HfDeepSpeedConfig": "hasten.utils.deepspeed",
    "PrefixedDataset": "hasten.utils.offload",
    "extract_submodules_state_dict": "hasten.utils.offload",
    # fp8 (torchao, TransformerEngine): hasten.training.float8 underneath
    "convert_model_to_fp8_ao": "hasten.utils.ao",
    "filter_first_and_last_linear_layers": "hasten.utils.ao",
    "has_ao_layers": "hasten.utils.ao",
    "apply_fp8_autowrap": "hasten.utils.transformer_engine",
    "contextual_fp8_autocast": "hasten.utils.transformer_engine",
    "convert_model": "hasten.utils.transformer_engine",
    "has_transformer_engine_layers": "hasten.utils.transformer_engine",
    # accelerate launch's helpers (the environment builders are refused: hasten launch builds its own)
    "PrepareForLaunch": "hasten.utils.launch",
    "prepare_multi_gpu_env": "hasten.utils.launch",
    "prepare_simple_launcher_cmd_env": "hasten.utils.launch",
    "avg_losses_across_data_parallel_group": "hasten.utils.megatron_lm",
    # hasten's throughput meter (Lightning Fabric's names; hasten.training.throughput)
    "Throughput": "hasten.training.throughput",
    "ThroughputMonitor": "hasten.training.throughput",
    "measure_flops": "hasten.training.throughput",
    "get_available_flops": "hasten.training.throughput",
    "compare_versions": "hasten.utils.versions",
    "is_torch_version": "hasten.utils.versions",
    "debug_launcher": "hasten.distributed.launchers",
    "notebook_launcher": "hasten.distributed.launchers",
    "skip_first_batches": "hasten.compat.data_loader",
    # Accelerate's global state: hasten's runtime imports hasten.utils.other, never these.
    "AcceleratorState": "hasten.compat.state",
    "GradientState": "hasten.compat.state",
    "PartialState": "hasten.compat.state",
}
_IMPORTS_MODULE = "hasten.utils.imports"  # the is_*_available helpers
_LAZY.update(dict.fromkeys(importlib.import_module(_IMPORTS_MODULE).__all__, _IMPORTS_MODULE))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [*_LAZY, *_EAGER, "ParallelismConfig", "GeneralTracker"]


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
