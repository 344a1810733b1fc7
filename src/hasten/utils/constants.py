"""``accelerate.utils.constants``: the file names of Accelerate's checkpoints and the other
constants of that module that mean something without DeepSpeed, XLA or SageMaker.

hasten's ``save_model`` writes ``SAFE_WEIGHTS_NAME`` or ``WEIGHTS_NAME`` (with the index
``SAFE_WEIGHTS_INDEX_NAME``/``WEIGHTS_INDEX_NAME`` when sharded), and ``load_state`` reads
Accelerate's ``save_state`` folders by these names: ``{MODEL_NAME}.bin`` or ``SAFE_WEIGHTS_NAME``
per model, ``{OPTIMIZER_NAME}.bin``, ``{SCHEDULER_NAME}.bin``, ``{SAMPLER_NAME}.bin``,
``{RNG_STATE_NAME}_{rank}.pkl`` and ``SCALER_NAME`` (``_{i}`` before the extension for the second
and later objects). ``PROFILE_PATTERN_NAME`` is Accelerate's trace name; hasten's profiler writes
``trace_rank{rank}.json``.
"""

from __future__ import annotations

import torch

from hasten.utils.versions import STR_OPERATION_TO_FUNC  # noqa: F401 - Accelerate keeps it in this module

# What accelerate.utils exports of this module; the other constants are imported from here by name.
__all__ = [
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_LAUNCH_PARAMS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
]

# ----------------------------------------------------------------------------- checkpoint file names
SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "random_states"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
#: ``ProfileKwargs(output_trace_dir=...)``'s trace of each process: ``suffix`` is the process index
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
#: the FSDP model file stem of ``save_fsdp_model`` (``{FSDP_MODEL_NAME}.bin``, ``_{i}`` after the first)
FSDP_MODEL_NAME = "pytorch_model_fsdp"

# ----------------------------------------------------------------------------- choices and versions
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
# Accelerate's: MS-AMP's docker image ships this pre-release of 2.1.0.
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"

#: the arguments of ``torch.distributed.run`` (``hasten launch`` passes them on)
TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]

#: ``DistributedType`` values whose collectives are torch.distributed's
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    *CUDA_DISTRIBUTED_TYPES,
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]
#: the layers whose outputs Accelerate's fp8 (Transformer Engine) path casts back up
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.Linear,
)
