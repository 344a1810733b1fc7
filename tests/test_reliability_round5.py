"""Issue #48, the fifth reliability round: merge_fsdp_weights never deletes its own output,
estimate-memory on a config of a billion layers, a project_dir that is not UTF-8, a JSON default
config, and a damaged checkpoint's one-line error in the launcher's summary."""

from __future__ import annotations

import json
import os
import time

import pytest

from hasten.cli import estimate_memory as em
from hasten.cli import main

# --------------------------------------------------------------------------- estimate-memory

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    architectures=["LlamaForCausalLM"],
)
TINY_T5 = dict(  # an encoder and a decoder: two stacks, two layer counts
    model_type="t5",
    vocab_size=64,
    d_model=8,
    d_kv=4,
    d_ff=16,
    num_heads=2,
    num_layers=3,
    num_decoder_layers=2,
    architectures=["T5ForConditionalGeneration"],
)


def _config(tmp_path, name: str, **fields) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(fields))
    return str(tmp_path / name)


def _without_names(report: dict) -> dict:
    out = json.loads(json.dumps(report))
    out["largest_layer"].pop("names")
    out["largest_layer"].pop("count", None)
    out.pop("repeated_layers", None)
    return out


@pytest.mark.parametrize(
    ("config", "fields"),
    [
        (TINY_LLAMA, {"num_hidden_layers": 11}),
        ({**TINY_LLAMA, "tie_word_embeddings": True}, {"num_hidden_layers": 9}),
        (TINY_T5, {"num_layers": 10, "num_decoder_layers": 7}),
    ],
)
def test_repeated_layers_are_counted_exactly_from_a_small_build(tmp_path, monkeypatch, config, fields):
    pytest.importorskip("transformers")
    folder = _config(tmp_path, "m", **{**config, **fields})
    dtypes = ["float32", "bfloat16", "int4"]
    full = em.estimate(em.build_model(folder), dtypes, num_processes=3, fsdp=True)  # every layer built
    monkeypatch.setattr(em, "FULL_BUILD_LAYERS", 5)
    monkeypatch.setattr(em, "SAMPLE_LAYERS", 4)
    with pytest.raises(em.TooManyLayers, match="more than the 5 built one by one"):
        em.build_model(folder)  # the API never builds a stack beyond the bound
    counted = em.estimate_spec(folder, dtypes=dtypes, num_processes=3, fsdp=True)
    assert _without_names(counted) == _without_names(full)
    assert counted["largest_layer"]["count"] == len(full["largest_layer"]["names"])
    assert counted["largest_layer"]["names"][0] == full["largest_layer"]["names"][0]
    assert {r["field"]: r["layers"] for r in counted["repeated_layers"]} == fields


def test_a_billion_layers_is_counted_in_seconds(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = _config(tmp_path, "huge", **{**TINY_LLAMA, "num_hidden_layers": 10**9})
    start = time.monotonic()
    assert main(["estimate-memory", folder, "--dtypes", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert time.monotonic() - start < 60
    # embeddings and an untied head 2 * 100*16, the final norm 16, per layer 2592 (test_estimate_memory)
    assert report["parameters"] == 2 * 1600 + 16 + 10**9 * 2592
    assert report["largest_layer"]["count"] == 10**9 and report["largest_layer"]["parameters"] == 2592
    assert report["rows"][0]["total"] == report["parameters"] * 4 + 8 * 4  # + the rotary buffers
    assert main(["estimate-memory", folder, "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "(and 999,999,999 more of the same size)" in out
    assert "num_hidden_layers=1,000,000,000: counted from a build of 65 layers" in out


def test_layers_that_differ_are_not_extrapolated(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    moe = dict(
        TINY_LLAMA,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        decoder_sparse_step=2,  # every second layer a mixture of experts
        num_hidden_layers=40,
    )
    folder = _config(tmp_path, "moe", **moe)
    monkeypatch.setattr(em, "FULL_BUILD_LAYERS", 5)
    monkeypatch.setattr(em, "SAMPLE_LAYERS", 4)
    with pytest.raises(SystemExit) as stop:
        main(["estimate-memory", folder])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers=40 is more layers than estimate-memory builds one by one (5)" in err
    assert "its layers 2 and 3 differ" in err


@pytest.mark.parametrize(
    ("value", "shown"),
    [("2", "'2' (str)"), (2.5, "2.5 (float)"), (True, "True (bool)"), (-1, "-1 (int)")],
)
def test_a_layer_count_of_the_wrong_type_is_a_usage_error(tmp_path, capsys, value, shown):
    pytest.importorskip("transformers")
    folder = _config(tmp_path, "bad", **{**TINY_LLAMA, "num_hidden_layers": value})
    with pytest.raises(SystemExit) as stop:
        main(["estimate-memory", folder])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"config.json: num_hidden_layers must be a number of layers (an integer >= 0), got {shown}" in err
    assert "Traceback" not in err


def test_another_field_of_the_wrong_type_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = _config(tmp_path, "bad", **{**TINY_LLAMA, "hidden_size": "16"})
    with pytest.raises(SystemExit) as stop:
        main(["estimate-memory", folder])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "MODEL" in err and "config.json: " in err and "hidden_size" in err and "Traceback" not in err


# --------------------------------------------------------------------------- merge_fsdp_weights


def _dcp_folder(folder) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["same", "inside", "deep", "link"])
def test_merge_never_deletes_its_own_output(tmp_path, where):
    from hasten.utils.fsdp_utils import merge_fsdp_weights

    checkpoint = tmp_path / "ckpt"
    _dcp_folder(checkpoint)
    before = _tree(checkpoint)
    output = {"same": checkpoint, "inside": checkpoint / "merged", "deep": checkpoint / "a" / ".." / "b"}.get(where)
    if where == "link":  # a link outside that points inside
        (tmp_path / "out").symlink_to(checkpoint)
        output = tmp_path / "out" / "merged"
    with pytest.raises(ValueError) as refused:
        merge_fsdp_weights(checkpoint, output, remove_checkpoint_dir=True)
    message = str(refused.value)
    assert f"the output folder {os.path.abspath(output)!r}" in message and repr(str(checkpoint)) in message
    assert "remove_checkpoint_dir=True would delete with the merged file" in message
    assert _tree(checkpoint) == before  # nothing written, nothing deleted


def test_merge_into_the_checkpoint_without_removing_it_and_elsewhere_with(tmp_path):
    import torch
    from safetensors.torch import load_file

    from hasten.utils.fsdp_utils import merge_fsdp_weights

    checkpoint = tmp_path / "ckpt"
    state = _dcp_folder(checkpoint)
    merge_fsdp_weights(checkpoint, checkpoint / "merged")  # kept: allowed, as before
    assert all(torch.equal(load_file(checkpoint / "merged" / "model.safetensors")[k], v) for k, v in state.items())
    merge_fsdp_weights(checkpoint, tmp_path / "ckpt2", remove_checkpoint_dir=True)  # a sibling sharing a prefix
    assert not checkpoint.exists()
    assert sorted(load_file(tmp_path / "ckpt2" / "model.safetensors")) == sorted(state)


# --------------------------------------------------------------------------- a project_dir not in UTF-8


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_a_project_dir_not_in_utf8_saves_and_loads(tmp_path, safe_serialization):
    import torch

    from hasten import Accelerator
    from hasten.checkpoint.merge import merge_weights
    from hasten.utils import ProjectConfiguration

    project = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")  # surrogate escapes
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(3, 2))
    saved = []
    for step in range(3):
        with torch.no_grad():
            model.weight.fill_(step)
        acc.save_state(safe_serialization=safe_serialization)
        saved.append(model.weight.detach().clone())
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state()  # the newest: checkpoint_2
    assert torch.equal(model.weight, saved[-1])
    newest = os.path.join(project, "checkpoints", "checkpoint_2")
    if safe_serialization:  # hasten merge-weights reads it too
        from safetensors.torch import load

        path = merge_weights(newest, os.path.join(project, "merged"))
        with open(path, "rb") as f:
            assert torch.equal(load(f.read())["weight"], saved[-1])
    acc.save_model(model, os.path.join(project, "model"), safe_serialization=safe_serialization)
    with torch.no_grad():
        model.weight.zero_()
    acc.load_model(model, os.path.join(project, "model"))
    assert torch.equal(model.weight, saved[-1])


# --------------------------------------------------------------------------- write_basic_config to .json


def test_write_basic_config_writes_json_to_a_json_file_and_launch_reads_it(tmp_path):
    pytest.importorskip("yaml")
    import sys

    import torch

    from hasten.settings.config_file import load_config
    from hasten.utils import write_basic_config

    sys.path.insert(0, os.path.dirname(__file__))
    from launch_utils import launch

    target = tmp_path / "sub" / "config.json"
    assert write_basic_config("BF16", save_location=target) == target
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = {"num_processes": max(gpus, 1), "cpu": gpus == 0, "mixed_precision": "bf16"}
    assert json.loads(target.read_text()) == expected  # JSON, as Accelerate's
    assert load_config(target).launch == expected  # what hasten launch reads
    assert not list(target.parent.glob("*.tmp"))
    script = tmp_path / "show.py"
    script.write_text("import os; print('precision', os.environ.get('HASTEN_MIXED_PRECISION'))\n")
    proc = launch("--config_file", str(target), "--num_processes", "1", "--cpu", str(script), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "precision bf16" in proc.stdout


# --------------------------------------------------------------------------- a known hasten error at launch


def _failure(rank: int, exc: BaseException | None, exitcode: int = 1, when: float = 0.0):
    """A torch ProcessFailure as the agent gives it, with the error file hasten's worker writes."""
    import traceback
    import types

    from hasten.cli import _child

    data = None
    if exc is not None:
        tb = exc.__traceback__
        extra = {"py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)), "hasten_time": when}
        if _child._known_error(exc, tb):
            extra["hasten_known"] = True
        data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": extra}}
    return types.SimpleNamespace(
        error_file_data=data,
        error_file="",
        exitcode=exitcode,
        local_rank=rank,
        pid=100 + rank,
        timestamp=when,
        message="",
        signal_name=lambda: "SIGTERM",
    )


def _raised(make):
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the exception with its traceback
        return e
    raise AssertionError("nothing raised")


def test_known_hasten_errors_are_told_apart_from_others():
    import torch

    from hasten import Accelerator
    from hasten.checkpoint.errors import CheckpointError, DamagedCheckpoint
    from hasten.cli._child import _known_error

    def user():
        raise ValueError("the script's own")

    known = [
        _raised(lambda: Accelerator(gradient_accumulation_steps=0)),  # hasten's validation
        _raised(lambda: Accelerator(mixed_precision=3)),
        DamagedCheckpoint("the checkpoint 'ck' is damaged"),
        CheckpointError("save_state: cannot write"),
    ]
    others = [_raised(user), _raised(lambda: torch.zeros(2).view(3)), RuntimeError("boom"), ValueError("no traceback")]
    assert [_known_error(e, e.__traceback__) for e in known] == [True] * 4
    assert [_known_error(e, e.__traceback__) for e in others] == [False] * 4


def test_a_known_error_is_one_line_and_its_traceback_goes_to_the_log(tmp_path):
    import types

    from hasten import Accelerator
    from hasten.cli._failures import describe_failure

    error = _raised(lambda: Accelerator(gradient_accumulation_steps=0))
    failures = {0: _failure(0, error, when=1.0), 1: _failure(1, None, exitcode=-15, when=2.0)}
    text, status = describe_failure(types.SimpleNamespace(failures=failures), str(tmp_path))
    assert status == 1
    assert "Traceback" not in text and "----" not in text, text
    lines = text.splitlines()
    assert lines[0].startswith("hasten launch: rank 0 failed first: it exited with code 1 (local rank 0, pid 100) at ")
    assert "test_reliability_round5.py:" in lines[0] and "Accelerator(gradient_accumulation_steps=0)" in lines[0]
    assert lines[1] == f"hasten launch: rank 0's traceback: {tmp_path / 'rank0.log'}"
    assert lines[-1] == "hasten launch: rank 0 failed with ValueError: " + str(error)
    assert "Traceback (most recent call last)" in (tmp_path / "rank0.log").read_text()
    # another error keeps its traceback on the console
    other = _raised(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    text, _ = describe_failure(types.SimpleNamespace(failures={0: _failure(0, other)}), str(tmp_path))
    assert "---- traceback of rank 0 ----" in text and "Traceback (most recent call last)" in text


def test_a_damaged_metadata_under_launch_is_one_line(tmp_path):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from launch_utils import SCRIPTS, free_port, launch

    proc = launch(
        "--cpu", "--num_processes", "2", "--main_process_port", str(free_port()), "--log_dir", tmp_path / "logs",
        SCRIPTS / "rel5_damaged.py", tmp_path, "metadata", timeout=150,
    )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 1, err[-4000:]
    summary = err[err.index("hasten launch: rank") :].strip().splitlines()
    assert len(summary) <= 6, err
    assert "Traceback" not in err and "---- traceback" not in err, err
    assert "rel5_damaged.py:" in summary[0] and "acc.load_state(ck)" in summary[0], summary
    assert summary[-1].startswith("hasten launch: rank ")
    assert " failed with DamagedCheckpoint: the checkpoint " in summary[-1]
    assert "'model_0/.metadata' cannot be read" in summary[-1]
    rank = summary[-1].split()[3]
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / f"rank{rank}.log").read_text()
