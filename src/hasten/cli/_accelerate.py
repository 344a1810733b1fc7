"""``accelerate launch`` flags that hasten does not implement, and what to use instead.

``hasten launch`` takes Accelerate's flag names. The ones it implements are ordinary flags
(see ``launch.py``); every other ``accelerate launch`` flag is listed here so that it is
refused with the hasten way of doing the same thing, instead of a bare "unrecognized
argument" (or, worse, being mistaken for the training script). The table also tells the
argument splitter which of these flags take a value.
"""

from __future__ import annotations

import argparse
from typing import Any

from hasten.settings.accelerate_config import _AWS, _MPI, _TPU  # the same words for a file's keys

_DEEPSPEED = (
    "hasten does not run DeepSpeed; it trains with DDP (hasten launch --num_processes N), "
    "with gradient accumulation from --gradient_accumulation_steps and clipping by accelerator.clip_grad_norm_()"
)
_FSDP = (
    "hasten shards with FSDP2 (--use_fsdp and --fsdp_version, --fsdp_auto_wrap_policy, "
    "--fsdp_transformer_layer_cls_to_wrap, --fsdp_min_num_params, --fsdp_reshard_after_forward, --fsdp_offload_params, "
    "--fsdp_state_dict_type, --fsdp_activation_checkpointing, --fsdp_activation_checkpointing_offload, "
    "--fsdp_cpu_ram_efficient_loading); this FSDP1 flag "
    "has no FSDP2 counterpart (README, 'Sharded training (FSDP2)', says how FSDP1's fields map)"
)
_MEGATRON = "hasten does not run Megatron-LM; it trains with DDP (hasten launch --num_processes N)"

# flag (underscore spelling, without --) -> (takes a value, what to do instead)
UNSUPPORTED: dict[str, tuple[bool, str]] = {
    "tpu": (False, _TPU),
    "tpu_cluster": (False, _TPU),
    "no_tpu_cluster": (False, _TPU),
    "tpu_use_sudo": (False, _TPU),
    "vm": (True, _TPU),
    "env": (True, _TPU + "; set environment variables before hasten launch, they reach every process"),
    "main_training_function": (True, _TPU + "; hasten runs the script (or -m module) as python would"),
    "downcast_bf16": (False, _TPU),
    "ipex": (False, "hasten has no IPEX mode; on Intel CPUs the default CPU training (gloo) runs as it is"),
    "use_xpu": (False, "hasten has no XPU launch mode; it runs on CPUs and CUDA GPUs"),
    "enable_cpu_affinity": (False, "hasten does not pin processes; use taskset or numactl around hasten launch"),
    "use_deepspeed": (False, _DEEPSPEED),
    "deepspeed_config_file": (True, _DEEPSPEED),
    "zero_stage": (True, _DEEPSPEED),
    "offload_optimizer_device": (True, _DEEPSPEED),
    "offload_param_device": (True, _DEEPSPEED),
    "offload_optimizer_nvme_path": (True, _DEEPSPEED),
    "offload_param_nvme_path": (True, _DEEPSPEED),
    "gradient_clipping": (True, "call accelerator.clip_grad_norm_(model.parameters(), max_norm) in the script"),
    "zero3_init_flag": (True, _DEEPSPEED),
    "zero3_save_16bit_model": (True, _DEEPSPEED),
    "deepspeed_hostfile": (True, _DEEPSPEED),
    "deepspeed_exclusion_filter": (True, _DEEPSPEED),
    "deepspeed_inclusion_filter": (True, _DEEPSPEED),
    "deepspeed_multinode_launcher": (True, _DEEPSPEED),
    "deepspeed_moe_layer_cls_names": (True, _DEEPSPEED),
    "use_megatron_lm": (False, _MEGATRON),
    "aws_access_key_id": (True, _AWS),
    "aws_secret_access_key": (True, _AWS),
    "mpirun_hostfile": (True, _MPI),
    "mpirun_ccl": (True, _MPI),
    "no_python": (
        False,
        "hasten runs Python scripts (or -m modules) only; run other programs with torchrun --no-python",
    ),
    "tee": (True, "hasten shows every rank's output on the console and keeps the failure logs in --log_dir"),
    "role": (True, "hasten does not name worker roles; drop the flag"),
    "debug": (
        False,
        "a failure shows the rank that failed first with its traceback, and every rank's log is kept in --log_dir",
    ),
}
# FSDP and Megatron-LM flags come in families.
_SP = (
    "it is a setting of DeepSpeed's sequence parallelism (ALST/Ulysses), which hasten does not run; hasten's "
    "Ulysses takes --parallelism_config_sp_size N (and --parallelism_config_sp_backend torch) and the model's own "
    "attention"
)
_FAMILIES = {"fsdp_": _FSDP, "megatron_lm_": _MEGATRON, "parallelism_config_sp_": _SP}
_SHORT = {"-t": "tee"}


def _canonical(option: str) -> str | None:
    """``--zero-stage=x`` -> ``zero_stage`` when it is an unsupported Accelerate flag."""
    if option in _SHORT:
        return _SHORT[option]
    if not option.startswith("--"):
        return None
    name = option[2:].split("=", 1)[0].replace("-", "_")
    from hasten.settings.launch_settings import LAUNCH_SETTINGS

    if name in LAUNCH_SETTINGS:  # implemented (e.g. the --fsdp_* flags of FSDP2)
        return None
    if name in UNSUPPORTED or any(name.startswith(prefix) for prefix in _FAMILIES):
        return name
    return None


def takes_value(option: str) -> bool | None:
    """Whether an unsupported Accelerate flag takes a value (None: not one of them)."""
    name = _canonical(option)
    if name is None:
        return None
    if name in UNSUPPORTED:
        return UNSUPPORTED[name][0]
    return True  # --fsdp_* and --megatron_lm_* all take a value


def advice(option: str) -> str | None:
    """The refusal of an unsupported Accelerate flag (None: not one of them)."""
    name = _canonical(option)
    if name is None:
        return None
    why = UNSUPPORTED[name][1] if name in UNSUPPORTED else next(v for p, v in _FAMILIES.items() if name.startswith(p))
    return f"{option.split('=', 1)[0]} is an accelerate launch flag that hasten does not implement: {why}"


def refuse_unsupported(parser: argparse.ArgumentParser, tokens: list[str]) -> None:
    """parser.error() for the first unsupported Accelerate flag among ``tokens`` (hasten's own options)."""
    for token in tokens:
        message = advice(token) if token.startswith("-") else None
        if message:
            parser.error(message)


def suggest(parser: argparse.ArgumentParser | Any, unknown: str) -> str:
    """The error text for an unknown option, with the closest known spelling when there is one."""
    import difflib

    name = unknown.split("=", 1)[0]
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    if not close:  # a dashed/underscored spelling mix: compare with both normalised
        normal = {s.replace("-", "_"): s for s in known}
        close = [normal[m] for m in difflib.get_close_matches(name.replace("-", "_"), list(normal), n=1, cutoff=0.75)]
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown option {name}{hint} (see {parser.prog} --help)"
