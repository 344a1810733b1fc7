"""Accelerate's config files work with `hasten launch` (issue 53): every version's key set, the
templates people copy, FSDP1's settings (file, flags, FSDP_* variables), Accelerate's default file,
refusals before any process starts, and a few real launches on 1, 2 and 4 gloo processes."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from hasten.cli import main
from hasten.settings import accelerate_config as acc_config
from hasten.settings import config_file as config

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks  # noqa: E402

REPORT = SCRIPTS / "accelerate_config_report.py"


@pytest.fixture(autouse=True)
def _homes(tmp_path, monkeypatch):
    """No real config file (hasten's or Accelerate's) is ever read."""
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "hasten-home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in [n for n in os.environ if n.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(name)


def write(folder: Path, text: str, name: str = "c.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def settings(path: Path, flags: dict | None = None, environ: dict | None = None, processes: int | None = None):
    """Every launch setting's (value, source) as `hasten launch` settles it, FSDP1 mapped."""
    cfg = config.load_config(path)
    resolved = config.resolve_settings(flags or {}, cfg, environ or {})
    notes = acc_config.apply_fsdp1(resolved, processes or resolved["num_processes"][0])
    return cfg, resolved, notes


def values(resolved: dict) -> dict:
    return {name: value for name, (value, source) in resolved.items() if source != "default"}


# ----------------------------------------------------------------------------- each version's key set

# What `accelerate config` wrote, version by version (Accelerate's tests/test_configs and cluster.py).
V0_11 = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: 'NO'
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: false
"""
V0_11_FSDP = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: FSDP
fsdp_config:
  sharding_strategy: 2
  offload_params: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: Block
  fsdp_backward_prefetch_policy: BACKWARD_PRE
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""
V0_14 = """\
command_file: null
commands: null
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_GPU
downcast_bf16: 'no'
fsdp_config: {}
gpu_ids: 0,1
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_name: null
tpu_zone: null
use_cpu: false
"""
V0_15 = V0_14.replace("distributed_type: MULTI_GPU\n", "distributed_type: MULTI_GPU\ndynamo_backend: AOT_EAGER\n")
V0_24_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
dynamo_config:
  dynamo_backend: 'NO'
fsdp_config:
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 100000000
  fsdp_backward_prefetch_policy: BACKWARD_POST
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
ipex_config:
  ipex: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
V0_28_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: 'no'
mpirun_config: {}
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""
V0_34_FP8 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
  amax_compute_algo: max
  amax_history_len: 1024
  backend: TE
  fp8_format: E4M3
  interval: 1
  margin: 0
  override_linear_precision: (false, false, false)
  use_autocast_during_eval: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
V1_6_TP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: TP
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tp_config:
  tp_size: 2
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
V1_6_FSDP1 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: SHARD_GRAD_OP
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
V1_15_ND = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
  parallelism_config_sp_size: 1
  parallelism_config_sp_backend: deepspeed
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (V0_11, {"num_processes": 1, "mixed_precision": "no", "cpu": False, "num_machines": 1}),
        (
            V0_11_FSDP,
            {
                "use_fsdp": True,
                "fsdp_reshard_after_forward": "false",  # torch's ShardingStrategy 2: SHARD_GRAD_OP
                "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                "fsdp_transformer_layer_cls_to_wrap": "Block",
                "fsdp_auto_wrap_policy": "transformer_based_wrap",
                "fsdp_backward_prefetch": "BACKWARD_PRE",
                "mixed_precision": "fp16",
            },
        ),
        (V0_14, {"num_processes": 2, "mixed_precision": "bf16", "rdzv_backend": "static"}),
        (V0_15, {"dynamo_backend": "aot_eager"}),
        (
            V0_24_FSDP,
            {
                "fsdp_reshard_after_forward": "true",
                "fsdp_auto_wrap_policy": "size_based_wrap",
                "fsdp_min_num_params": 100000000,
                "fsdp_backward_prefetch": "BACKWARD_POST",
                "dynamo_backend": "no",
                "fsdp_cpu_ram_efficient_loading": "true",
            },
        ),
        (V0_28_MULTI_CPU, {"cpu": True, "num_processes": 4, "main_process_port": 29500}),
        (
            V0_34_FP8,
            {
                "fp8_backend": "TE",
                "fp8_format": "E4M3",
                "fp8_override_linear_precision": "false,false,false",
                "fp8_amax_compute_algo": "max",
                "mixed_precision": "fp8",
            },
        ),
        (V1_6_TP, {"use_parallelism_config": True, "parallelism_config_tp_size": 2}),
        (
            V1_6_FSDP1,
            {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": "false", "use_fsdp": True},
        ),
        (
            V1_15_ND,
            {
                "use_parallelism_config": True,
                "parallelism_config_dp_replicate_size": 2,
                "parallelism_config_tp_size": 2,
                "fsdp_version": 2,
                "fsdp_activation_checkpointing": "true",
            },
        ),
    ],
    ids=[
        "0.11",
        "0.11-fsdp",
        "0.14",
        "0.15",
        "0.24-fsdp",
        "0.28-multi-cpu",
        "0.34-fp8",
        "1.6-tp",
        "1.6-fsdp1",
        "1.15-nd",
    ],
)
def test_every_versions_key_set_is_read(tmp_path, text, expected):
    cfg, resolved, _ = settings(write(tmp_path, text))
    assert cfg.format == "accelerate"
    got = values(resolved)
    assert {k: got.get(k) for k in expected} == expected
    assert "fsdp_version" not in got or got["fsdp_version"] == 2  # FSDP1's files run as FSDP2


def test_json_files_and_what_config_show_says(tmp_path, capsys):
    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
            "mixed_precision": "bf16", "gpu_ids": "0,1", "debug": True, "downcast_bf16": "no",
            "main_training_function": "main", "tpu_use_cluster": False}  # fmt: skip
    path = write(tmp_path, json.dumps(data, indent=2), "default_config.json")
    cfg = config.load_config(path)
    assert cfg.format == "accelerate" and cfg.gpu_ids == "0,1" and cfg.debug is True
    assert cfg.launch == {"num_processes": 2, "mixed_precision": "bf16"}
    assert main(["config", "show", "--config_file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"# config file: {path.resolve()}" in out and "# format: Accelerate's" in out
    assert "gpu_ids 0,1 -> CUDA_VISIBLE_DEVICES" in out and "HASTEN_DEBUG_MODE" in out
    assert "mixed_precision: bf16" in out and "# config file" in out
    for key in ("downcast_bf16", "main_training_function", "tpu_use_cluster"):  # inert keys are named
        assert f"# does nothing here: {key}" in out, out


def test_format_is_decided_by_the_marker_keys_only(tmp_path):
    # hasten's own format: distributed_type absent, so Accelerate's keys are unknown there (with why)
    with pytest.raises(ValueError) as caught:
        config.load_config(write(tmp_path, "num_processes: 2\nuse_cpu: true\n"))
    assert "unknown key 'use_cpu'" in str(caught.value) and "Accelerate's format" in str(caught.value)
    # Accelerate's format: hasten's own keys are unknown there, all named at once with their lines
    text = (
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_proceses: 2\n"
        "gradient_accumulation_steps: 4\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n"
        "dynamo_config:\n  dynamo_bakend: inductor\nddp: {bucket_cap_mb: 50}\n"
    )
    with pytest.raises(ValueError) as caught:
        config.load_config(write(tmp_path, text))
    message = str(caught.value)
    for part in (
        "unknown keys in an Accelerate config file",
        "'num_proceses' (line 3; did you mean 'num_processes'?)",
        "'gradient_accumulation_steps' (line 4; hasten's own key: give --gradient_accumulation_steps",
        "'fsdp_sharding_stratgy' (line 6; in fsdp_config; did you mean 'fsdp_sharding_strategy'?)",
        "'dynamo_bakend' (line 8; in dynamo_config; did you mean 'dynamo_backend'?)",
        "'ddp' (line 9",
    ):
        assert part in message, message


def test_empty_sections_and_accepted_keys_of_old_files(tmp_path):
    text = V0_11.replace("fsdp_config: {}\n", "fsdp_config: {}\nmegatron_lm_config: {}\nmpirun_config: {}\n")
    cfg = config.load_config(write(tmp_path, text + "ipex_config: {ipex: false, use_xpu: false}\n"))
    assert cfg.launch["num_processes"] == 1 and cfg.notes == []
    # sections of what is not run are ignored unless distributed_type asks for them (as in Accelerate)
    cfg = config.load_config(
        write(tmp_path, V0_11.replace("deepspeed_config: {}", "deepspeed_config: {zero_stage: 2}"))
    )
    assert any("deepspeed_config: ignored" in line and "not DEEPSPEED" in line for line in cfg.inert)
    # num_processes -1 ("pass --num_processes") leaves the count open; enable_cpu_affinity is said
    cfg = config.load_config(
        write(
            tmp_path,
            V0_34_FP8.replace("num_processes: 2", "num_processes: -1").replace("affinity: false", "affinity: true"),
        )
    )
    assert "num_processes" not in cfg.launch
    assert any("num_processes -1" in n for n in cfg.notes) and any("enable_cpu_affinity" in n for n in cfg.notes)


# ----------------------------------------------------------------------------- refused before anything starts

HEAD = "compute_environment: LOCAL_MACHINE\nnum_processes: 2\n"


@pytest.mark.parametrize(
    "text, words",
    [
        (
            HEAD + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n"
            "  gradient_clipping: 1.0\n",
            [
                "line 3",
                "distributed_type DEEPSPEED",
                "ZeRO stage 3 is FSDP2",
                "fsdp_reshard_after_forward: true",
                "fsdp_offload_params: true",
                "clip_grad_norm_",
            ],
        ),
        (
            HEAD + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n",
            ["ZeRO stage 2", "fsdp_reshard_after_forward: false"],
        ),
        (
            HEAD + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n",
            ["zero_optimization.stage", "ZeRO stage 0", "ZeRO stage 3"],
        ),
        (
            HEAD + "distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"
            "  megatron_lm_pp_degree: 2\n",
            ["Megatron-LM", "parallelism_config_tp_size: 2", "parallelism_config_pp_size: 2"],
        ),
        (HEAD + "distributed_type: XLA\n", ["distributed_type XLA", "TPUs are not supported", "MULTI_GPU"]),
        (HEAD + "distributed_type: TPU\n", ["distributed_type TPU", "TPUs are not supported"]),
        (HEAD + "distributed_type: MULTI_NPU\n", ["distributed_type MULTI_NPU", "CPUs and CUDA GPUs"]),
        (HEAD + "distributed_type: MULTI_XPU\n", ["distributed_type MULTI_XPU", "CPUs and CUDA GPUs"]),
        (HEAD + "distributed_type: ZERO\n", ["distributed_type must be one of", "'ZERO'"]),
        (
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\n",
            ["compute_environment AMAZON_SAGEMAKER", "SageMaker"],
        ),
        (HEAD + "distributed_type: MULTI_CPU\nmpirun_config:\n  mpirun_hostfile: /h\n", ["line 5", "mpirun"]),
        (
            HEAD
            + "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
            + "  parallelism_config_sp_backend: deepspeed\n",
            ["line 6", "DeepSpeed's sequence parallelism", "parallelism_config_sp_backend: torch"],
        ),
        (
            HEAD + "distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
            ["line 5", "LOCAL_STATE_DICT is FSDP1's", "SHARDED_STATE_DICT"],
        ),
        (HEAD + "distributed_type: MULTI_CPU\nuse_cpu: maybe\n", ["line 4", "[use_cpu] cpu must be"]),
        (HEAD + "distributed_type: MULTI_CPU\nbogus: 1\nother: 2\n", ["'bogus' (line 4)", "'other' (line 5)"]),
        ("compute_environment: LOCAL_MACHINE\nnum_processes: 2\n", ["needs distributed_type"]),
    ],
    ids=[
        "ds-zero3",
        "ds-zero2",
        "ds-file",
        "megatron",
        "xla",
        "tpu",
        "npu",
        "xpu",
        "bad-type",
        "sagemaker",
        "mpirun",
        "sp",
        "local-sd",
        "bad-value",
        "unknown",
        "no-type",
    ],  # fmt: skip
)
def test_what_hasten_cannot_run_is_refused_before_any_process_starts(tmp_path, capsys, text, words):
    path = write(tmp_path, text)
    marker = tmp_path / "started"
    script = write(tmp_path, f"open({str(marker)!r}, 'w').close()\n", "train.py")
    with pytest.raises(SystemExit) as exit:
        main(["launch", "--config_file", str(path), str(script)])
    assert exit.value.code == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert f"hasten launch: error: {path}" in err
    for word in words:
        assert word in err, err


# ----------------------------------------------------------------------------- FSDP1 settings, any source


def test_fsdp1_flags_variables_and_files_map_alike(tmp_path):
    hasten_file = write(tmp_path, "fsdp: {sharding_strategy: SHARD_GRAD_OP, use_orig_params: false}\n", "h.yaml")
    accelerate_file = write(tmp_path, V1_6_FSDP1, "a.yaml")
    for path in (hasten_file, accelerate_file):  # the same meaning in both formats
        _, resolved, notes = settings(path)
        assert resolved["fsdp_reshard_after_forward"] == ("false", "config file: fsdp_sharding_strategy SHARD_GRAD_OP")
        assert resolved["use_fsdp"][0] is True and notes and "FSDP1 settings run with FSDP2" in notes[0]
    # flag > environment > file
    env = {"FSDP_SHARDING_STRATEGY": "1"}  # torch's number of FULL_SHARD, as Accelerate's old launcher set it
    _, resolved, _ = settings(hasten_file, environ=env)
    assert resolved["fsdp_reshard_after_forward"] == (
        "true",
        "environment FSDP_SHARDING_STRATEGY: fsdp_sharding_strategy FULL_SHARD",
    )
    _, resolved, _ = settings(hasten_file, flags={"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, environ=env)
    assert resolved["fsdp_reshard_after_forward"][0] == "false"
    # an explicit FSDP2 setting from a stronger source wins over the strategy; the same source disagreeing is refused
    _, resolved, _ = settings(hasten_file, flags={"fsdp_reshard_after_forward": "true"})
    assert resolved["fsdp_reshard_after_forward"] == ("true", "flag")
    clash = write(tmp_path, "fsdp: {sharding_strategy: SHARD_GRAD_OP, reshard_after_forward: true}\n", "x.yaml")
    with pytest.raises(ValueError, match="fsdp_sharding_strategy SHARD_GRAD_OP means fsdp_reshard_after_forward false"):
        settings(clash)


def test_hybrid_and_no_shard(tmp_path):
    text = V1_6_FSDP1.replace("SHARD_GRAD_OP", "HYBRID_SHARD").replace("num_machines: 1", "num_machines: 2")
    text = text.replace("main_training_function", "main_process_ip: 10.0.0.1\nmain_training_function")
    _, resolved, notes = settings(write(tmp_path, text.replace("num_processes: 2", "num_processes: 8")))
    got = values(resolved)
    assert (got["parallelism_config_dp_replicate_size"], got["parallelism_config_dp_shard_size"]) == (2, 4)
    assert got["use_parallelism_config"] is True and got["fsdp_reshard_after_forward"] == "true"
    assert "HSDP: parallelism_config_dp_replicate_size 2 (the machines) x dp_shard_size 4" in notes[0]
    # one machine: sharded over every process
    _, resolved, notes = settings(write(tmp_path, V1_6_FSDP1.replace("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")))
    assert values(resolved)["fsdp_reshard_after_forward"] == "false" and "use_parallelism_config" not in values(
        resolved
    )
    # NO_SHARD: DDP, unless a stronger source asks for FSDP
    path = write(tmp_path, V1_6_FSDP1.replace("SHARD_GRAD_OP", "NO_SHARD"))
    _, resolved, notes = settings(path)
    assert resolved["use_fsdp"][0] is False and "NO_SHARD = DDP" in notes[0]
    with pytest.raises(ValueError, match="use_fsdp \\(flag\\) asks for FSDP, but fsdp_sharding_strategy NO_SHARD"):
        settings(path, flags={"use_fsdp": True})


def test_fsdp1_launch_flags_are_taken_and_shown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH")
    argv = ["config", "show", "--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_use_orig_params",
            "true", "--fsdp_forward_prefetch", "false", "--fsdp_sync_module_states", "true"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "# note: FSDP1 settings run with FSDP2: fsdp_sharding_strategy SHARD_GRAD_OP = fsdp_reshard_after_forward false"
        in out
    )
    assert re.search(r"\nfsdp_reshard_after_forward: 'false' +# flag: fsdp_sharding_strategy SHARD_GRAD_OP\n", out)
    assert re.search(r"\nfsdp_backward_prefetch: NO_PREFETCH +# environment FSDP_BACKWARD_PREFETCH\n", out)
    with pytest.raises(SystemExit):
        main(["launch", "--fsdp_sharding_strategy", "FULLY", "x.py"])
    assert "fsdp_sharding_strategy must be one of 'FULL_SHARD'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Accelerate's default file


def test_accelerate_default_file_is_found_and_named(tmp_path, monkeypatch, capsys):
    assert config.find_config_file() is None
    theirs = tmp_path / "hf-home" / "accelerate" / "default_config.yaml"
    assert acc_config.accelerate_default_config_path() == theirs
    theirs.parent.mkdir(parents=True)
    theirs.write_text(V0_28_MULTI_CPU)
    assert config.find_config_file() == theirs.resolve() and config.is_accelerate_default(theirs.resolve())
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert f"# config file: {theirs.resolve()} (Accelerate's default config file" in out
    assert "cpu: true" in out
    from hasten.cli.env import env_lines

    assert f"config file: {theirs.resolve()} (Accelerate's default config file, in Accelerate's format)" in env_lines()
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert acc_config.accelerate_default_config_path() == tmp_path / "xdg" / "huggingface" / theirs.relative_to(
        theirs.parents[1]
    )
    # hasten's own default file wins over Accelerate's
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    ours = config.write_config(config.default_config_path(), {"num_processes": 1})
    assert config.find_config_file() == ours.resolve() and not config.is_accelerate_default(ours.resolve())


# ----------------------------------------------------------------------------- real launches


def _run(tmp_path: Path, name: str, text: str, *flags: str, env: dict | None = None, n: int) -> tuple[list, str]:
    out = tmp_path / name
    out.mkdir()
    args = [*flags]
    if text:
        args += ["--config_file", write(tmp_path, text, f"{name}.yaml")]
    proc = launch(*args, "--main_process_port", free_port(), REPORT, out, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return read_ranks(out, n), proc.stderr


OLD_WITH_DYNAMO = V0_11.replace(
    "use_cpu: false\n", "use_cpu: false\ndebug: true\ndynamo_config:\n  dynamo_backend: AOT_EAGER\n"
)


def test_one_process_from_accelerates_default_file(tmp_path):
    """An old file with empty sections plus a dynamo section, found as Accelerate's default file."""
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(OLD_WITH_DYNAMO)
    (rank,), err = _run(tmp_path, "old", "", env=launch_env(HF_HOME=str(home)), n=1)
    assert f"hasten launch: reading Accelerate's config file {home / 'accelerate' / 'default_config.yaml'}" in err
    assert rank["processes"] == 1 and rank["distributed_type"] == "NO" and rank["mixed_precision"] == "no"
    assert rank["dynamo_backend"] == "aot_eager" and rank["debug_mode"] == "1" and rank["loss_finite"]


MULTI_CPU_FP8 = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
fp8_config:
  backend: AO
  enable_fsdp_float8_all_gather: false
  pad_inner_dim: true
mixed_precision: fp8
num_machines: 1
num_processes: 2
use_cpu: true
ipex_config:
  ipex: false
mpirun_config: {}
"""

FSDP2_TEMPLATE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.mark.slow  # > 20 s: make test-slow
def test_two_processes_multi_cpu_fp8_and_fsdp2(tmp_path):
    ranks, _ = _run(tmp_path, "fp8", MULTI_CPU_FP8, n=2)
    for rank in ranks:
        assert rank["processes"] == 2 and rank["distributed_type"] == "MULTI_CPU" and rank["backend"] == "gloo"
        assert rank["mixed_precision"] == "fp8" and rank["fp8_backend"] == "AO"
        # every Linear but the first and the last (Accelerate's filter): 5 - 2
        assert rank["float8_layers"] == 3 and rank["fsdp_version"] is None
    ranks, err = _run(tmp_path, "fsdp2", FSDP2_TEMPLATE, n=2)
    assert "FSDP1" not in err
    for rank in ranks:
        assert rank["distributed_type"] == "FSDP" and rank["mixed_precision"] == "bf16"
        assert (rank["fsdp_version"], rank["state_dict_type"], rank["reshard_after_forward"]) == (
            2, "FULL_STATE_DICT", True,
        )  # fmt: skip
        assert rank["block_sharded"] == "DTensor" and rank["wrap"] == "transformer_based_wrap"


FSDP1_HSDP = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_use_orig_params: true
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: 4
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
use_cpu: false
"""


def test_four_processes_fsdp1_style_file_with_a_parallelism_config(tmp_path):
    ranks, err = _run(tmp_path, "hsdp", FSDP1_HSDP, n=4)
    assert "hasten launch: FSDP1 settings run with FSDP2: fsdp_sharding_strategy HYBRID_SHARD_ZERO2" in err
    for rank in ranks:
        assert rank["processes"] == 4 and rank["distributed_type"] == "FSDP"
        assert (rank["fsdp_version"], rank["state_dict_type"], rank["reshard_after_forward"]) == (
            2, "SHARDED_STATE_DICT", False,
        )  # fmt: skip
        assert rank["mesh"]["dp_replicate"] == 2 and rank["mesh"]["dp_shard"] == 2
        assert rank["block_sharded"] == "DTensor" and rank["loss_finite"]


def test_fsdp_ignored_modules_reaches_the_plugin(tmp_path, monkeypatch):
    text = V1_15_ND.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_ignored_modules: head\n")
    assert config.load_config(write(tmp_path, text)).launch["fsdp_ignored_modules"] == "head"
    assert config.load_config(write(tmp_path, V1_6_FSDP1 + "")).launch.get("fsdp_ignored_modules") is None
    from hasten.settings.plugins import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_IGNORED_MODULES", "head")  # what hasten launch exports from it
    assert FullyShardedDataParallelPlugin().ignored_modules == "head"
