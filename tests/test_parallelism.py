"""N-D parallelism (ParallelismConfig, issue 26): one 4-process launch of scripts/nd_checks.py
through ``hasten launch --use_parallelism_config ...`` doing many checks (HSDP 2x2, TP 2 x FSDP 2,
TP 4, DDP, checkpoint reshapes); loading at one process, merge-weights, the launcher's flags and
config section, and bad input here, in-process."""

from __future__ import annotations

import json

import pytest
import torch
from nd_common import Net, dataset

from conftest import SCRIPTS
from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from hasten.settings.parallelism import TorchContextParallelConfig
from launch_utils import free_port, launch, launch_env

TOL = 1e-5
PARITY = [
    "hsdp_2x2",
    "tp2_fsdp2",
    "tp4",
    "ddp_4",
    "fsdp_4",
    "hsdp_accum_ac",
    "tp2_fsdp2_accum_ac",
    "tp2_fsdp2_adopted",
    "replicate2_tp2",
    "tp2_fsdp2_meta_elsewhere",
    "tp2_fsdp2_compiled",
]
SHAPES = {  # case -> (dp_replicate, dp_shard, tp)
    "hsdp_2x2": (2, 2, 1),
    "tp2_fsdp2": (1, 2, 2),
    "tp4": (1, 1, 4),
    "ddp_4": (4, 1, 1),
    "fsdp_4": (1, 4, 1),
    "hsdp_accum_ac": (2, 2, 1),
    "tp2_fsdp2_accum_ac": (1, 2, 2),
    "tp2_fsdp2_adopted": (1, 2, 2),
    "replicate2_tp2": (2, 1, 2),
    "tp2_fsdp2_meta_elsewhere": (1, 2, 2),
    "tp2_fsdp2_compiled": (1, 2, 2),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("nd")
    proc = launch(
        "--num_processes",
        "4",
        "--main_process_port",
        str(free_port()),
        "--use_parallelism_config",
        "--parallelism_config_dp_replicate_size",
        "2",
        "--parallelism_config_dp_shard_size",
        "2",
        SCRIPTS / "nd_checks.py",
        str(out),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.fixture(scope="module")
def ranks(launched):
    return launched[1]


def _ok(entry):
    assert "error" not in entry, entry.get("error")
    return entry


def test_the_launcher_flags_reach_the_accelerator(ranks):
    for res in ranks:
        entry = _ok(res["from_launcher"])
        assert entry["sizes"] == [2, 2, 1, 1] and entry["env"] == "true"
        assert entry["distributed_type"] == "FSDP"
        assert entry["mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "cp", "sp", "tp"]


@pytest.mark.parametrize("case", PARITY)
def test_trains_like_one_process_with_the_global_batch(ranks, case):
    for res in ranks:
        entry = _ok(res[case])
        assert len(entry["losses"]) == len(entry["ref_losses"]) >= 3
        torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(entry["ref_losses"]), rtol=TOL, atol=TOL)
        # clipping: the global norm over the whole mesh, the same on every process
        torch.testing.assert_close(torch.tensor(entry["norms"]), torch.tensor(entry["ref_norms"]), rtol=TOL, atol=TOL)
        assert entry["norms"] == ranks[0][case]["norms"]
    main = ranks[0][case]
    assert main["weight_diff"] is not None and main["weight_diff"] <= TOL
    assert main["keys"] == [
        "blocks.0.a.bias",
        "blocks.0.a.weight",
        "blocks.0.b.bias",
        "blocks.0.b.weight",
        "blocks.1.a.bias",
        "blocks.1.a.weight",
        "blocks.1.b.bias",
        "blocks.1.b.weight",
        "head.bias",
        "head.weight",
    ]  # the model's own keys, full, on the main process


def test_mixed_precision_trains_close_to_fp32(ranks):
    entry = _ok(ranks[0]["tp2_fsdp2_bf16"])
    torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(entry["ref_losses"]), rtol=2e-2, atol=2e-2)
    assert entry["weight_diff"] > 0  # bf16 did change the numbers: the policy was applied


@pytest.mark.parametrize("case", PARITY)
def test_accessors_and_the_mesh(ranks, case):
    r, s, t = SHAPES[case]
    seen = set()
    for rank, res in enumerate(ranks):
        entry = _ok(res[case])
        assert entry["mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "cp", "sp", "tp"] and entry["mesh_shape"] == [
            1,
            r,
            s,
            1,
            1,
            t,
        ]
        assert entry["flattened"] == {"dp": r * s, "dp_shard_cp": s, "dp_cp": r * s}
        ranks_ = entry["ranks"]
        # row-major over (dp_replicate, dp_shard, cp, tp): neighbouring processes share a tp group
        assert ranks_ == {
            "dp_replicate": rank // (s * t),
            "dp_shard": rank // t % s,
            "tp": rank % t,
            "cp": 0,
            "dp": rank // t,
        }
        seen.add((ranks_["dp_replicate"], ranks_["dp_shard"], ranks_["tp"]))
    assert len(seen) == 4
    expected_type = "MULTI_CPU" if case == "ddp_4" else "FSDP"  # dp_replicate alone runs as DDP
    assert ranks[0][case]["distributed_type"] == expected_type


@pytest.mark.parametrize("case", PARITY)
def test_tp_ranks_read_the_same_batch_data_ranks_disjoint_ones(ranks, case):
    by_dp: dict[int, list] = {}
    for res in ranks:
        entry = _ok(res[case])
        by_dp.setdefault(entry["ranks"]["dp"], []).append(entry["first_batch"])
    r, s, t = SHAPES[case]
    assert len(by_dp) == r * s
    for batches in by_dp.values():
        assert len(batches) == t and all(b == batches[0] for b in batches)  # TP ranks: the same batch
    samples = [i for batches in by_dp.values() for i in batches[0]]
    assert len(samples) == len(set(samples)) == 2 * r * s  # data ranks: disjoint, together the global batch
    assert ranks[0][case]["loader_len"] == 96 // (2 * r * s)


def test_an_iterable_dataset_is_read_once_per_data_group(ranks):
    entries = [_ok(res["iterable_tp2_fsdp2"]) for res in ranks]
    by_dp = {}
    for e in entries:
        by_dp.setdefault(e["dp"], []).append(e["batches"])
    assert sorted(by_dp) == [0, 1] and all(a == b for a, b in by_dp.values())  # TP ranks: the same batches
    seen = [i for batches in (v[0] for v in by_dp.values()) for b in batches for i in b]
    assert sorted(seen) == list(range(40))  # the data groups together read the stream once
    refused = entries[0]["refused"]
    assert refused["type"] == "ValueError"
    assert "dispatch_batches=True) is not supported with ParallelismConfig(tp_size=2)" in refused["message"]


def test_tensor_parallel_parameters_live_on_the_2d_mesh(ranks):
    assert _ok(ranks[0]["tp2_fsdp2"])["param_meshes"] == ["('dp_shard_cp', 'tp')", "('dp_shard_cp',)"]
    assert _ok(ranks[0]["hsdp_2x2"])["param_meshes"] == ["('dp_replicate', 'dp_shard_cp')"]
    assert _ok(ranks[0]["replicate2_tp2"])["param_meshes"] == [
        "('dp_replicate', 'dp_shard_cp')",
        "('dp_replicate', 'dp_shard_cp', 'tp')",
    ]
    assert ranks[0]["tp2_fsdp2_adopted"]["param_meshes"] == ranks[0]["tp2_fsdp2"]["param_meshes"]


def test_a_transformers_model_is_parallelised_with_its_own_plan(ranks):
    entry = _ok(ranks[0]["llama_own_plan"])
    if "skipped" in entry:
        pytest.skip(entry["skipped"])
    # LlamaForCausalLM._tp_plan: the vocabulary-split embedding, attention and MLP, lm_head gathered
    torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(entry["ref_losses"]), rtol=TOL, atol=TOL)
    assert entry["weight_diff"] <= TOL and entry["keys_match"]
    assert entry["param_meshes"] == ["('dp_shard_cp', 'tp')", "('dp_shard_cp',)"]


def test_save_model_and_load_model_with_tensor_parallel_shards(ranks):
    assert _ok(ranks[0]["model_files_tp2_fsdp2"])["diff"] == 0.0


def test_a_model_without_a_plan_or_a_plan_naming_nothing_is_refused_unchanged(ranks):
    for res in ranks:
        no_plan, nothing = res["no_plan"], res["plan_names_nothing"]
        assert no_plan["type"] == "ValueError" and "needs a tensor-parallel plan" in no_plan["message"]
        assert "Net has none" in no_plan["message"] and no_plan["unchanged"]
        assert nothing["type"] == "ValueError" and nothing["unchanged"]
        assert (
            "tp_plan['layers.*.q'] names no module of Net" in nothing["message"] and "blocks.0.a" in nothing["message"]
        )


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ("ck_save_hsdp", "ck_hsdp_at_fsdp4"),
        ("ck_save_hsdp", "ck_hsdp_at_replicate4"),
        ("ck_save_hsdp", "ck_hsdp_at_tp2_fsdp2"),
        ("ck_save_tp2_fsdp2", "ck_tp_at_fsdp4"),
        ("ck_save_tp2_fsdp2", "ck_tp_at_tp4"),
        ("ck_save_tp2_fsdp2_full", "ck_tp_full_at_hsdp"),  # FULL_STATE_DICT: the "full" layout, gathered and re-sharded
    ],
)
def test_checkpoints_load_at_another_mesh_shape(ranks, saved, loaded):
    save, load = _ok(ranks[0][saved]), _ok(ranks[0][loaded])
    torch.testing.assert_close(load["loaded"], save["saved"], rtol=0, atol=1e-6)
    # the exact data position, also at another data-parallel size: the next samples follow the saved ones
    consumed = save["consumed"]
    assert load["next"] == list(range(consumed, consumed + 2 * load["dp"]))
    if load["dp"] * 2 == len(save["next"]):  # the same global batch: the same step as the saving run's next
        torch.testing.assert_close(load["after_step"], save["params"], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", ["hsdp", "tp"])
def test_a_sharded_nd_checkpoint_loads_at_one_process_and_merges(launched, tmp_path, name):
    from safetensors.torch import load_file

    from hasten.cli import main

    out, _ = launched
    folder = out / "ck" / name
    expected = torch.load(str(folder) + ".weights.pt")
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(folder)
    for k, t in expected.items():
        torch.testing.assert_close(model.state_dict()[k], t, rtol=0, atol=0)
    assert main(["merge-weights", str(folder), str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(expected)
    for k, t in expected.items():
        torch.testing.assert_close(merged[k], t, rtol=0, atol=0)


# ---------------------------------------------------------------------- in-process: bad input, launcher
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"tp_size": 0}, ValueError, ("ParallelismConfig.tp_size", "0", ">= 1")),
        ({"dp_shard_size": -2}, ValueError, ("ParallelismConfig.dp_shard_size", "-2")),
        ({"dp_replicate_size": "2"}, TypeError, ("ParallelismConfig.dp_replicate_size", "'2'", "integer")),
        ({"cp_size": 1.5}, TypeError, ("ParallelismConfig.cp_size", "1.5")),
        ({"tp_size": True}, TypeError, ("ParallelismConfig.tp_size", "True")),
        (
            {"tp_size": 2, "tp_plan": {"a": "diagonal"}},
            ValueError,
            ("tp_plan['a']", "'diagonal'", "colwise", "rowwise"),
        ),
        ({"tp_size": 2, "tp_plan": ["a"]}, TypeError, ("tp_plan", "dict")),
        ({"cp_handler": "ring"}, TypeError, ("cp_handler", "TorchContextParallelConfig")),
    ],
)
def test_bad_sizes_are_refused_at_construction(kwargs, error, words):
    with pytest.raises(error) as info:
        ParallelismConfig(**kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_handlers_are_checked_and_defaulted():
    assert ParallelismConfig(tp_size=2).tp_handler is not None
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "allgather"
    with pytest.raises(ValueError, match="cp_comm_strategy must be one of 'allgather', 'alltoall', got 'ring'"):
        TorchContextParallelConfig(cp_comm_strategy="ring")


def test_sizes_come_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "3")
    pc = ParallelismConfig(tp_size=1)  # code wins
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (1, 2, 1, 1)
    assert ParallelismConfig.from_env() is None
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    assert ParallelismConfig.from_env().total_size == 6
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(
        ValueError, match="environment variable PARALLELISM_CONFIG_TP_SIZE must be an integer, got 'two'"
    ):
        ParallelismConfig()


def test_sequence_parallel_sizes_come_from_the_launcher(monkeypatch, tmp_path):
    """--parallelism_config_sp_size/_sp_backend (and an Accelerate config file's keys) reach
    ParallelismConfig through PARALLELISM_CONFIG_SP_*; the product counts sp."""
    from hasten.settings.launch_settings import LAUNCH_SETTINGS

    assert {"parallelism_config_sp_size", "parallelism_config_sp_backend"} <= set(LAUNCH_SETTINGS)
    proc = _launch_refusal(
        tmp_path, "--num_processes", "2", "--cpu", "--use_parallelism_config", "--parallelism_config_sp_size", "4"
    )
    assert proc.returncode == 2 and "multiplies to 4, but there are 2 process(es)" in proc.stderr, proc.stderr
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "torch")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    pc = ParallelismConfig()
    assert (pc.sp_size, pc.sp_backend, pc.total_size) == (2, "torch", 4)
    with pytest.raises(ValueError, match=r"x sp_size must equal the number of processes"):
        pc.check_num_processes(2)


def test_accelerate_views():
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert pc.total_size == 8 and pc.data_parallel_size == 4 and pc.non_data_parallel_size == 2
    assert pc.dp_dim_names == ["dp_replicate", "dp_shard"] and pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert pc.active_mesh_dims == ["dp_replicate", "dp_shard", "tp"]
    assert pc._get_mesh() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))


def test_a_product_that_is_not_the_process_count_is_refused_naming_each_size():
    with pytest.raises(ValueError) as info:
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2))
    msg = str(info.value)
    for w in ("dp_replicate_size=2", "dp_shard_size=2", "tp_size=2", "cp_size=1", "multiplies to 8", "1 process(es)"):
        assert w in msg, (w, msg)


def test_context_parallel_on_cpu_is_refused_naming_why():
    with pytest.raises(ValueError, match=r"cp_size=2\) needs CUDA.*'cpu'.*scaled_dot_product_attention"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))


def test_one_process_with_sizes_of_one_runs_as_before():
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    assert acc.torch_device_mesh is None
    assert (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank) == (0, 0, 0)
    with acc.maybe_context_parallel(buffers=[torch.zeros(2, 3)], buffer_seq_dims=[1]):
        pass  # a no-op with cp_size 1
    with pytest.raises(RuntimeError, match="not configured"):
        _ = Accelerator(cpu=True).tensor_parallel_rank
    with pytest.raises(TypeError, match="parallelism_config must be a ParallelismConfig"):
        Accelerator(cpu=True, parallelism_config={"tp_size": 2})


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="context parallelism runs on CUDA only (SDPA's flash/efficient kernels), one GPU per cp rank: needs 2",
)
def test_context_parallel_splits_the_sequence_on_cuda(tmp_path):
    proc = launch(
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        SCRIPTS / "nd_cp.py",
        str(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "rank0.json").read_text())
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(res["ref_losses"]), rtol=1e-3, atol=1e-3)


def test_plan_resolution_in_process():
    from hasten.strategies import tensor_parallel as tp

    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert tp.resolve(model, {"0": "colwise", "2": "rowwise"}, "plan") == {"0": "colwise", "2": "rowwise"}
    with pytest.raises(ValueError, match=r"plan\['1'\] = 'colwise' matches '1', a ReLU"):
        tp.resolve(model, {"1": "colwise"}, "plan")

    class HF(torch.nn.Module):  # a transformers-style model: config.base_model_tp_plan below base_model_prefix
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(2, 2)])})
            self.config = type("C", (), {"base_model_tp_plan": {"layers.*": "colwise"}})()

    plan, where = tp.model_plan(HF(), None)
    assert plan == {"model.layers.*": "colwise"} and "base_model_tp_plan" in where
    assert tp.resolve(HF(), plan, where) == {"model.layers.0": "colwise"}


def _launch_refusal(tmp_path, *args):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    return launch(*args, str(script), timeout=60, env=launch_env())


def test_the_launcher_refuses_a_product_mismatch_before_starting_workers(tmp_path):
    proc = _launch_refusal(
        tmp_path,
        "--num_processes",
        "4",
        "--cpu",
        "--parallelism_config_dp_shard_size",
        "2",
        "--parallelism_config_tp_size",
        "3",
    )
    assert proc.returncode == 2, proc.stderr
    assert "multiplies to 6, but there are 4 process(es)" in proc.stderr and "a worker started" not in proc.stderr


def test_the_config_file_section_sets_the_sizes(tmp_path):
    from hasten.settings.config_file import load_config

    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 4\nparallelism_config:\n  dp_shard_size: 2\n  parallelism_config_tp_size: 2\n")
    cfg = load_config(path)
    assert cfg.launch["parallelism_config_dp_shard_size"] == 2 and cfg.launch["parallelism_config_tp_size"] == 2
    assert cfg.launch["use_parallelism_config"] is True
    path.write_text("parallelism_config:\n  tp_sise: 2\n")
    with pytest.raises(ValueError, match=r"line 2: unknown key 'tp_sise'; did you mean 'tp_size'"):
        load_config(path)
    path.write_text("num_processes: 4\nparallelism_config:\n  dp_shard_size: 3\n")
    proc = _launch_refusal(tmp_path, "--config_file", str(path), "--cpu")
    assert proc.returncode == 2 and "multiplies to 3, but there are 4 process(es)" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--parallelism_config_sp_seq_length", "2048"],
            "--parallelism_config_sp_seq_length is an accelerate launch flag that hasten does not",
        ),
        (
            ["--parallelism_config_sp_backend", "deepspeed"],
            "parallelism_config_sp_backend must be one of 'torch', got 'deepspeed'",
        ),
        (
            ["--parallelism_config_cp_backend", "deepspeed"],
            "parallelism_config_cp_backend must be one of 'torch', got 'deepspeed'",
        ),
        (["--parallelism_config_cp_comm_strategy", "ring"], "must be one of 'allgather', 'alltoall', got 'ring'"),
    ],
)
def test_accelerate_flags_hasten_lacks_are_refused_by_name(argv, words, capsys):
    from hasten.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", *argv, "train.py"])
    assert info.value.code == 2 and words in capsys.readouterr().err
