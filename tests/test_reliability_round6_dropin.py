"""Issue 57, "Drop-in gaps a new user hit" and "Smaller": what an Accelerate user's habits meet.

Each test failed before its fix: the FSDP recipe without ``fsdp_transformer_layer_cls_to_wrap``, FSDP1's
``sharding_strategy`` in code, the default config file's ``mixed_precision: no`` warning, torchrun's
``PET_*`` variables, one process without a thread count, ``zero_stage: [3]``, Accelerate 1.16's names,
and ``log_with="wandb"`` without wandb.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hasten import Accelerator  # noqa: E402
from hasten.cli import main  # noqa: E402
from hasten.settings.plugins import FullyShardedDataParallelPlugin as Plugin  # noqa: E402
from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks, start_launch  # noqa: E402

PROBE = SCRIPTS / "round6_dropin_probe.py"

# The shape TRL's and the alignment handbook's FSDP recipes ship: no fsdp_transformer_layer_cls_to_wrap.
RECIPE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
"""

# Accelerate's default config file (`accelerate config default`).
DEFAULT_FILE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: 'NO'
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: false
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("HASTEN_", "ACCELERATE_", "FSDP_", "PET_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self, no_split: list[str] | None) -> None:
        super().__init__()
        if no_split is not None:
            self._no_split_modules = no_split
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


# ---------------------------------------------------------------------- 1. the FSDP recipe


def test_transformer_based_wrap_without_class_names_wraps_the_models_no_split_modules():
    from hasten.strategies.parallelize import BlockPolicy, select_blocks

    plugin = Plugin(auto_wrap_policy="transformer_based_wrap")  # refused before: "needs transformer_cls_names_to_wrap"
    assert plugin.auto_wrap_policy == "transformer_based_wrap" and plugin.transformer_cls_names_to_wrap is None
    policy = BlockPolicy(plugin.auto_wrap_policy, (), plugin.min_num_params)
    model = Net(["Block", "AudioLayer"])  # a class it does not build is passed over, as Accelerate does
    assert select_blocks(model, policy) == list(model.blocks)
    with pytest.raises(ValueError, match=r"has no _no_split_modules.*transformer_cls_names_to_wrap=\[\.\.\.\]"):
        select_blocks(Net(None), policy)
    with pytest.raises(ValueError, match=r"lists \['AudioLayer'\], none of which it contains.*Block"):
        select_blocks(Net(["AudioLayer"]), policy)


def test_no_block_found_names_the_config_key_file_and_line(tmp_path, monkeypatch):
    from hasten.strategies.parallelize import BlockPolicy, select_blocks

    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(path))  # as hasten launch exports them from the file
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "transformer_based_wrap")
    monkeypatch.setenv("HASTEN_FROM_CONFIG_FILE", "HASTEN_USE_FSDP,FSDP_AUTO_WRAP_POLICY")
    plugin = Plugin()
    with pytest.raises(ValueError) as err:
        select_blocks(Net(None), BlockPolicy(plugin.auto_wrap_policy, (), None))
    text = str(err.value)
    assert f"Add fsdp_transformer_layer_cls_to_wrap to the fsdp section of {path}" in text, text
    assert "line 6" in text and "Block" in text, text


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_the_recipe_launches_and_shards_each_block_on_two_processes(tmp_path):
    (tmp_path / "out").mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    proc = launch(
        "--config_file", recipe, "--main_process_port", free_port(), PROBE, tmp_path / "out", "fsdp", timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    for rank in read_ranks(tmp_path / "out", 2):
        assert rank["distributed_type"] == "FSDP" and rank["processes"] == 2
        assert rank["blocks_are_units"] == [True, True] and not rank["head_is_unit"], rank


def test_config_show_refuses_what_launch_refuses(tmp_path, capsys):
    # A group size that does not divide the processes: hasten launch refuses it before any worker starts.
    bad = RECIPE.replace("  fsdp_sharding_strategy: FULL_SHARD\n", "  fsdp_reshard_after_forward: 3\n")
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", "--config_file", str(path)])
    assert exit_info.value.code == 2
    assert "reshard_after_forward=3 must divide the number of processes" in capsys.readouterr().err
    assert "FSDP_RESHARD_AFTER_FORWARD" not in os.environ  # the check's exports are undone
    path.write_text(RECIPE)
    assert main(["config", "show", "--config_file", str(path)]) == 0  # the recipe is fine for both


# ---------------------------------------------------------------------- 2. FSDP1 strategies in code


@pytest.mark.parametrize(
    "given, reshard",
    [
        ("FULL_SHARD", True),
        ("full_shard", True),
        ("SHARD_GRAD_OP", False),
        ("ShardingStrategy.SHARD_GRAD_OP", False),
        ("HYBRID_SHARD", True),
        ("_HYBRID_SHARD_ZERO2", False),
        ("HYBRID_SHARD_ZERO2", False),
        (1, True),
        (2, False),
        (4, True),
        (5, False),
        ("2", False),
    ],
)
def test_sharding_strategy_in_code_maps_to_fsdp2_as_in_files(given, reshard):
    from hasten.settings.accelerate_config import apply_fsdp1
    from hasten.settings.config_file import resolve_settings
    from hasten.settings.launch_settings import parse_setting_text

    plugin = Plugin(sharding_strategy=given)
    assert plugin.reshard_after_forward is reshard
    # the same strategy from a config file or flag: the same reshard_after_forward
    flag = parse_setting_text("fsdp_sharding_strategy", str(given))  # as `--fsdp_sharding_strategy X` reads it
    resolved = resolve_settings({"use_fsdp": True, "fsdp_sharding_strategy": flag}, None, environ={})
    apply_fsdp1(resolved, 2)
    assert resolved["fsdp_reshard_after_forward"][0] == ("true" if reshard else "false")


def test_torch_sharding_strategy_enum_and_the_other_strategies():
    from torch.distributed.fsdp import ShardingStrategy

    from hasten.settings.resolve import fsdp1_strategy

    for member in ShardingStrategy:
        plugin = Plugin(sharding_strategy=member)
        assert plugin.sharding_strategy == member.name.lstrip("_")
    # NO_SHARD is DDP, as from a file (no FSDP plugin); an explicit NO_SHARD with a sharding mesh is refused
    assert fsdp1_strategy(Plugin(sharding_strategy="NO_SHARD"), None) == (None, None)
    from hasten import ParallelismConfig

    with pytest.raises(ValueError, match="sharding_strategy='NO_SHARD'.*asks not to shard"):
        fsdp1_strategy(Plugin(sharding_strategy=3), ParallelismConfig(dp_shard_size=2))
    # HYBRID_SHARD is HSDP: one replica per machine, sharded over its processes
    hybrid = Plugin(sharding_strategy="HYBRID_SHARD")
    assert hybrid.hybrid_dims(8, 4) == (2, 4) and hybrid.hybrid_dims(4, 4) is None
    assert Plugin(sharding_strategy="FULL_SHARD").hybrid_dims(8, 4) is None


def test_hybrid_shard_in_code_builds_the_hsdp_mesh_from_the_launchers_world(monkeypatch):
    from hasten.settings.resolve import fsdp1_strategy

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 machines x 2 processes
    plugin, config = fsdp1_strategy(Plugin(sharding_strategy="HYBRID_SHARD"), None)
    assert plugin.reshard_after_forward is True
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 2)


# ---------------------------------------------------------------------- 3. mixed precision from the default file


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_code_over_the_config_files_mixed_precision_is_silent(tmp_path):
    (tmp_path / "quiet").mkdir()
    (tmp_path / "flag").mkdir()
    path = tmp_path / "default_config.yaml"
    path.write_text(DEFAULT_FILE)
    proc = launch("--config_file", path, PROBE, tmp_path / "quiet", "env", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rank,) = read_ranks(tmp_path / "quiet", 1)
    assert rank["mixed_precision"] == "bf16"
    assert not [w for w in rank["warnings"] if "overrides" in w], rank["warnings"]
    # A flag the user typed still gets its warning (the code wins).
    proc = launch("--config_file", path, "--mixed_precision", "no", PROBE, tmp_path / "flag", "env", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rank,) = read_ranks(tmp_path / "flag", 1)
    assert any("overrides HASTEN_MIXED_PRECISION='no'" in w for w in rank["warnings"]), rank["warnings"]


def test_a_variable_the_user_set_still_warns(monkeypatch):
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "no")
    with pytest.warns(UserWarning, match="overrides HASTEN_MIXED_PRECISION='no'"):
        Accelerator(mixed_precision="bf16", cpu=True)
    monkeypatch.setenv("HASTEN_FROM_CONFIG_FILE", "HASTEN_MIXED_PRECISION")  # what hasten launch sets from a file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Accelerator(mixed_precision="bf16", cpu=True).mixed_precision == "bf16"


# ---------------------------------------------------------------------- 4, 5. PET_* and threads


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_torchruns_pet_variables_start_the_processes_they_name(tmp_path):
    (tmp_path / "pet").mkdir()
    env = launch_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1")
    env["PET_MASTER_PORT"] = str(free_port())
    proc = launch(PROBE, tmp_path / "pet", "env", env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = read_ranks(tmp_path / "pet", 2)
    assert [r["world_size"] for r in ranks] == ["2", "2"] and all(r["processes"] == 2 for r in ranks)
    # a flag given too wins, and the disagreement is named
    (tmp_path / "flag").mkdir()
    proc = launch("--num_processes", "1", PROBE, tmp_path / "flag", "env", env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_ranks(tmp_path / "flag", 1)[0]["processes"] == 1
    assert "--num_processes/--nproc_per_node 1 overrides PET_NPROC_PER_NODE x machines" in proc.stderr, proc.stderr


def test_pet_values_are_read_as_torchrun_reads_them():
    from hasten.cli._torchrun_env import pet_settings

    got = pet_settings(
        {"PET_NNODES": "2:4", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1", "PET_MASTER_PORT": "29500"}
    )
    assert got["num_machines"][0] == 2 and got["max_machines"][0] == 4 and got["num_processes"][0] == 6
    assert got["machine_rank"] == (1, "PET_NODE_RANK") and got["main_process_port"][0] == 29500
    assert pet_settings({"PET_NPROC_PER_NODE": "cpu"})["num_processes"][0] == len(os.sched_getaffinity(0))
    assert pet_settings({}) == {}
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE must be a number >= 1, 'gpu', 'cpu' or 'auto'.*'two'"):
        pet_settings({"PET_NPROC_PER_NODE": "two"})
    with pytest.raises(ValueError, match="PET_NNODES must be a number >= 1.*'x'"):
        pet_settings({"PET_NNODES": "x"})


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_one_process_gets_the_same_thread_rule_as_n(tmp_path):
    (tmp_path / "one").mkdir()
    env = launch_env()
    env.pop("OMP_NUM_THREADS")
    proc = launch(PROBE, tmp_path / "one", "env", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rank,) = read_ranks(tmp_path / "one", 1)
    cores = len(os.sched_getaffinity(0))
    assert rank["omp_num_threads"] == str(cores) and rank["torch_threads"] == cores, rank
    (tmp_path / "own").mkdir()
    env["OMP_NUM_THREADS"] = "1"  # the user's own value stays
    assert launch(PROBE, tmp_path / "own", "env", env=env, timeout=120).returncode == 0
    assert read_ranks(tmp_path / "own", 1)[0]["omp_num_threads"] == "1"


# ---------------------------------------------------------------------- 6. zero_stage: [3]


def test_a_list_zero_stage_is_an_error_naming_file_line_key_and_value(tmp_path, capsys):
    path = tmp_path / "ds.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: [3]\n"
    )
    with pytest.raises(SystemExit):
        main(["config", "show", "--config_file", str(path)])
    err = capsys.readouterr().err
    assert f"{path}, line 4: deepspeed_config: zero_stage must be one of DeepSpeed's stages 0, 1, 2 or 3" in err
    assert "got [3]" in err and "unhashable" not in err


# ---------------------------------------------------------------------- 7. Accelerate 1.16's names


def test_logging_verbosity_functions():
    import hasten.logging as hl

    library = logging.getLogger("hasten")
    saved = library.level
    try:
        hl.set_verbosity_debug()
        assert hl.get_verbosity() == logging.DEBUG
        hl.set_verbosity_error()
        assert hl.get_verbosity() == logging.ERROR and logging.getLogger("hasten.checkpoint").getEffectiveLevel() == 40
        hl.set_verbosity("info")
        assert hl.get_verbosity() == logging.INFO
        hl.set_verbosity_warning()
        assert hl.get_verbosity() == logging.WARNING
        root = logging.getLogger().level
        hl.set_verbosity_info()
        assert library.level == logging.INFO and logging.getLogger().level == root  # the root logger is left alone
        with pytest.raises(ValueError, match="verbosity"):
            hl.set_verbosity("loud")
    finally:
        library.setLevel(saved)


def test_device_backend_helpers_on_this_machine():
    from hasten.utils import (
        get_accelerator_free_memory,
        get_distributed_backend,
        get_torch_accelerator_backend,
        normalize_device,
    )

    kind, module = get_torch_accelerator_backend()
    if torch.cuda.is_available():
        assert (kind, module) == ("cuda", torch.cuda)
        assert get_accelerator_free_memory(module, 0) == torch.cuda.mem_get_info(0)[0]
    else:
        assert (kind, module) == (None, None)
    assert get_distributed_backend("cuda") == "nccl" and get_distributed_backend(None) is None
    assert get_distributed_backend("cpu") is None and get_distributed_backend("npu") == "hccl"
    assert normalize_device("npu") == "npu:0" and normalize_device("cpu") == "cpu"
    assert normalize_device(0) == 0  # CUDA, or no accelerator: the index stays


def test_memory_helpers_the_trainer_imports():
    from hasten.utils.memory import clear_device_cache, should_reduce_batch_size

    clear_device_cache()
    clear_device_cache(garbage_collection=True)
    assert should_reduce_batch_size(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert should_reduce_batch_size(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("CUDA out of memory."))
    import hasten.utils

    assert "clear_device_cache" not in hasten.utils.__all__  # as in Accelerate: only at utils.memory


def test_deepspeed_sequence_parallel_config_takes_116s_fields():
    from hasten.utils import DeepSpeedSequenceParallelConfig

    config = DeepSpeedSequenceParallelConfig(sp_allow_recurrent_layers=True, sp_disable_in_eval=False)
    assert config.sp_allow_recurrent_layers is True and config.sp_disable_in_eval is False
    default = DeepSpeedSequenceParallelConfig()
    assert default.sp_allow_recurrent_layers is False and default.sp_disable_in_eval is True
    with pytest.raises(TypeError, match="sp_disable_in_eval must be True or False"):
        DeepSpeedSequenceParallelConfig(sp_disable_in_eval="no")


# ---------------------------------------------------------------------- 8. a tracker not installed


def test_log_with_a_missing_tracker_trains_on_with_one_warning(monkeypatch):
    import hasten.tracking as tracking

    monkeypatch.setitem(sys.modules, "wandb", None)
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setattr(tracking, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"'wandb' package is not installed.*pip install wandb") as record:
        acc = Accelerator(log_with="wandb", cpu=True)
    assert len([w for w in record if "wandb" in str(w.message)]) == 1
    acc.init_trackers("proj", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=0)  # nothing to log to, no error
    assert acc.get_tracker("wandb").log({"x": 1}) is None  # a blank tracker
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(log_with="wandb", cpu=True)  # once per process
    acc.end_training()


# ---------------------------------------------------------------------- the CLI's errors redact URLs


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "--mixed_precision", "s3://KEY:Hidden-Secret@bucket/x", "train.py"],
        ["config", "show", "--config_file", "CONFIG"],
        ["launch", "--config_file", "CONFIG", "train.py"],
    ],
)
def test_a_password_in_a_flag_or_config_value_never_reaches_the_console(argv, tmp_path, capsys):
    # argparse quotes a refused value in its error: a URL's password there is hidden as in every message.
    config = tmp_path / "cfg.yaml"
    config.write_text(
        'compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: "s3://KEY:Hidden-Secret@b"\n'
    )
    with pytest.raises(SystemExit) as exit_info:
        main([str(config) if a == "CONFIG" else a for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "mixed_precision" in err
    assert "hidden-secret" not in err.lower() and ":***@b" in err


@pytest.mark.slow  # two launchers, 4 processes
def test_hybrid_shard_in_code_on_two_machines_replicates_across_them(tmp_path):
    port = str(free_port())
    common = ("--num_machines", "2", "--num_processes", "4", "--main_process_ip", "127.0.0.1")
    script = (SCRIPTS / "hsdp_two_machines.py", tmp_path)
    machines = [
        start_launch(*common, "--main_process_port", port, "--machine_rank", str(r), "--cpu", *script) for r in (0, 1)
    ]
    outs = [m.communicate(timeout=240) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outs
    ranks = read_ranks(tmp_path, 4)
    for r in ranks:
        assert r["sizes"] == [2, 2], r  # replicate 2 (machines) x shard 2 (the processes of one machine)
        shard, replicate = r["groups"]["dp_shard"], r["groups"]["dp_replicate"]
        assert {ranks[i]["machine"] for i in shard} == {r["machine"]}, r  # a shard group within one machine
        assert {ranks[i]["machine"] for i in replicate} == {0, 1}, r  # replicas on the two machines
        for i in replicate:
            assert ranks[i]["local"] == r["local"], (r["rank"], i)  # the replicas' shards stayed equal
    assert ranks[0]["local"] != ranks[1]["local"]  # different shards within a machine
