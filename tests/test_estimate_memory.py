"""`hasten estimate-memory`: figures checked against a hand count, FSDP's per-process division,
models built on the meta device, and the refusals of bad input (exit status 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torch import nn

from hasten.cli import main
from hasten.cli.estimate_memory import build_model, estimate
from hasten.utils import convert_bytes

# Linear(10, 20) + ReLU + Linear(20, 30): 10*20+20 = 220 and 20*30+30 = 630 parameters, 850 in all.
MODELS = '''
from torch import nn

class Stack(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 30))

class Normed(nn.Module):
    """Linear(4, 6) (30 parameters) and BatchNorm1d(6): 12 parameters, 2x6 float buffers, 1 int64 buffer."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight

class Huge(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1 << 20, 1 << 20, bias=False)  # 2**40 parameters: 4 TiB in float32

class NeedsArgs(nn.Module):
    def __init__(self, width, depth=2):
        super().__init__()

def factory():
    return Stack()

def not_a_module():
    return 3

NUMBER = 7
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A module `em_models` importable from the working directory, as a user's would be."""
    (tmp_path / "em_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("em_models", None)
    yield tmp_path
    sys.modules.pop("em_models", None)


def _rows(report: dict) -> dict[str, dict]:
    return {row["dtype"]: row for row in report["rows"]}


def test_figures_match_a_hand_count(models):
    model = build_model("em_models:Stack")
    assert {p.device.type for p in model.parameters()} == {"meta"}  # nothing allocated
    report = estimate(model, ["float32", "bfloat16", "float16", "int8", "int4"])
    assert report["parameters"] == 850
    assert report["largest_layer"] == {"names": ["2"], "parameters": 630}
    rows = _rows(report)
    # (largest layer, total, training with Adam = weights + gradients + 2 Adam states = 4x)
    assert [rows["float32"][k] for k in ("largest_layer", "total", "training_adam")] == [2520, 3400, 13600]
    assert rows["float32"]["training"] == {
        "weights": 3400,
        "gradients": 3400,
        "optimizer_states": 6800,
        "gathered_layer": 0,
    }
    for half in ("bfloat16", "float16"):  # Accelerate's 16-bit training figure: 2x the float32 size
        assert [rows[half][k] for k in ("largest_layer", "total", "training_adam")] == [1260, 1700, 6800]
    assert [rows["int8"][k] for k in ("largest_layer", "total", "training_adam")] == [630, 850, None]
    # int4: half a byte per element, rounded up per tensor: 600/2 + 30/2 = 315; 200/2 + 20/2 = 110
    assert [rows["int4"][k] for k in ("largest_layer", "total", "training_adam")] == [315, 425, None]


def test_fsdp_divides_each_parameter_over_the_processes(models):
    model = build_model("em_models:factory")  # a function called with no arguments works too
    rows = _rows(estimate(model, ["float32", "int8"], num_processes=3, fsdp=True))
    # fully_shard splits each parameter along dim 0 into 3 padded chunks of ceil(rows/3) rows:
    # weight (20, 10) -> 7x10, bias (20,) -> 7, weight (30, 20) -> 10x20, bias (30,) -> 10: 287 elements
    shard = 287 * 4
    largest = 630 * 4  # gathered whole, however many processes
    assert rows["float32"]["largest_layer"] == largest
    assert rows["float32"]["total"] == shard + largest
    assert rows["float32"]["training"] == {
        "weights": shard,
        "gradients": shard,
        "optimizer_states": 2 * shard,
        "gathered_layer": 2 * largest,  # its weights, and its gradients before the reduce-scatter
    }
    assert rows["float32"]["training_adam"] == 4 * shard + 2 * largest
    assert rows["int8"]["total"] == 287 + 630 and rows["int8"]["training_adam"] is None
    # without --fsdp every process holds the whole model: N changes nothing
    assert estimate(model, ["float32"], num_processes=4)["rows"] == estimate(model, ["float32"])["rows"]
    # ten processes: a 20-row weight gives 2 rows each; 30 rows give 3
    ten = _rows(estimate(model, ["float32"], num_processes=10, fsdp=True))["float32"]
    assert ten["training"]["weights"] == (2 * 10 + 2 + 3 * 20 + 3) * 4


def test_buffers_are_whole_on_every_process_and_have_no_gradients(models):
    report = estimate(build_model("em_models:Normed"), ["float32", "int8"], num_processes=2, fsdp=True)
    assert report["parameters"] == 30 + 12
    rows = _rows(report)
    # shards: fc weight (6, 4) -> 3x4, bias 3, bn weight 3, bias 3 = 21 elements; buffers: 12 floats + 1 int64
    assert rows["float32"]["training"]["weights"] == 21 * 4 + 12 * 4 + 8
    assert rows["float32"]["training"]["gradients"] == 21 * 4
    assert rows["int8"]["total"] - rows["int8"]["largest_layer"] == 21 + 12 + 8  # the int64 keeps its 8 bytes


def test_tied_parameters_count_once_and_a_huge_model_costs_nothing(models):
    tied = estimate(build_model("em_models:Tied"), ["float32"])
    assert tied["parameters"] == 50 * 8 and tied["rows"][0]["total"] == 50 * 8 * 4
    huge = build_model("em_models:Huge")
    assert huge.fc.weight.is_meta
    row = estimate(huge, ["float32"])["rows"][0]
    assert row["total"] == 4 << 40 and convert_bytes(row["total"]) == "4.0 TB"
    assert row["largest_layer"] == 4 << 40  # a model of one layer: the whole model


def test_convert_bytes_writes_as_accelerate():
    assert [convert_bytes(n) for n in (850, 2520, 1.5 * 1024**3)] == ["850 bytes", "2.46 KB", "1.5 GB"]


def test_command_prints_the_table_and_json(models, capsys):
    assert main(["estimate-memory", "em_models:Stack"]) == 0
    out = capsys.readouterr().out
    assert "Memory Usage for loading `em_models:Stack`" in out
    for header in ("dtype", "Largest Layer", "Total Size", "Training using Adam"):
        assert header in out
    assert "│ float32 │    2.46 KB    │  3.32 KB   │       13.28 KB      │" in out
    assert "int4" in out and "425 bytes" in out and "N/A" in out and "bfloat16" not in out  # Accelerate's rows
    assert "850 parameters (Stack); largest layer: `2`, 630 parameters" in out
    argv = ["estimate-memory", "em_models:Stack", "--fsdp", "--num_processes", "3", "--dtypes", "float32", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "em_models:Stack" and report["num_processes"] == 3 and report["fsdp"] is True
    assert report["rows"][0]["total"] == 287 * 4 + 630 * 4
    assert main(["estimate-memory", "em_models:Stack", "--fsdp", "--num_processes", "2"]) == 0
    assert "per process (FSDP over 2 processes)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["em_models:NeedsArgs"], "MODEL 'em_models:NeedsArgs' needs arguments (width)"),
        (["em_models:Missing"], "MODEL 'em_models:Missing': 'em_models' has no attribute 'Missing'"),
        (["no_such_module_x:Net"], "MODEL 'no_such_module_x:Net': no module named 'no_such_module_x'"),
        (["em_models:NUMBER"], "MODEL 'em_models:NUMBER' is a int, not a class or function"),
        (["em_models:not_a_module"], "MODEL 'em_models:not_a_module' built a int, not a torch.nn.Module"),
        (["em_models:"], "expected module:Class"),
        (["./no_such_folder"], "MODEL './no_such_folder': no such folder"),
        (["em_models.py"], "MODEL 'em_models.py' is a file; give the folder holding its config.json"),
        (["empty_folder"], "MODEL 'empty_folder': the folder has no config.json"),
        (
            ["em_models:Stack", "--dtypes", "float32", "fp8"],
            "--dtypes: unknown dtype 'fp8'; allowed: float32, bfloat16",
        ),
        (["em_models:Stack", "--num_processes", "0"], "--num_processes must be at least 1, got 0"),
        (["em_models:Stack", "--num_processes", "two"], "--num_processes: invalid int value: 'two'"),
    ],
)
def test_bad_input_is_a_usage_error(models, capsys, argv, message):
    (models / "empty_folder").mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["estimate-memory", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_estimate_refuses_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="dtypes: unknown dtype 'float8'"):
        estimate(model, ["float8"])
    with pytest.raises(ValueError, match="num_processes must be an int of at least 1, got 0"):
        estimate(model, num_processes=0)


def _hasten(*argv: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from hasten.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def test_hub_name_offline_is_a_clear_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = _hasten("estimate-memory", "some-org/some-model", env=env, cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "MODEL 'some-org/some-model': no such folder, and its config.json cannot be fetched" in proc.stderr
    assert "offline (HF_HUB_OFFLINE)" in proc.stderr and "Traceback" not in proc.stderr


def test_listed_in_help_and_not_imported_by_hasten():
    proc = _hasten("--help")
    assert proc.returncode == 0 and "estimate-memory" in proc.stdout
    check = (
        "import sys, hasten\n"
        "from hasten.cli import main\n"
        "assert 'hasten.cli.estimate_memory' not in sys.modules\n"
        "try:\n    main(['estimate-memory', '--help'])\nexcept SystemExit as stop:\n    assert stop.code == 0\n"
        "assert 'torch' not in sys.modules, 'estimate-memory --help imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--num_processes" in proc.stdout and "--fsdp" in proc.stdout and "--json" in proc.stdout


TINY_LLAMA = dict(
    vocab_size=100,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    architectures=["LlamaForCausalLM"],
)


@pytest.mark.parametrize(("tied", "parameters"), [(False, 8400), (True, 6800)])
def test_transformers_config_folder(tmp_path, capsys, tied, parameters):
    transformers = pytest.importorskip("transformers", reason="transformers (the test extra) builds config.json models")
    transformers.LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tied).save_pretrained(tmp_path / "tiny")
    model = build_model(str(tmp_path / "tiny"))
    assert type(model).__name__ == "LlamaForCausalLM"  # the config's architecture, its head included
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    # embeddings 100*16 (+ an untied head 100*16) + final norm 16 + per layer: q, k, v, o 4*16*16,
    # MLP 3*16*32, 2 norms 2*16 = 2592
    report = estimate(model, ["float32"])
    assert report["parameters"] == parameters == 1600 * (1 if tied else 2) + 16 + 2 * 2592
    assert report["largest_layer"] == {"names": ["model.layers.0", "model.layers.1"], "parameters": 2592}
    rotary = 8 * 4  # inv_freq and original_inv_freq: 4 floats each
    row = report["rows"][0]
    assert row["total"] == parameters * 4 + rotary and row["training_adam"] == 4 * parameters * 4 + rotary
    assert main(["estimate-memory", str(tmp_path / "tiny"), "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert f"{parameters:,} parameters (LlamaForCausalLM)" in out and "(and 1 more of the same size)" in out


def test_transformers_unknown_model_type_is_an_error(tmp_path, capsys):
    pytest.importorskip("transformers", reason="transformers (the test extra) reads config.json")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert main(["estimate-memory", str(tmp_path / "odd")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hasten estimate-memory: ") and "no-such-architecture" in err, err
