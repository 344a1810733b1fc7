"""Issue 41, ``accelerate.utils`` (first half): each name imports from Accelerate's module path and
from ``hasten.utils``, and behaves as Accelerate's on a small example.

One process in this interpreter; one launch of 2 processes checks ``wait_for_everyone``, ``save``
(written by the main process only) and ``synchronize_rng_state`` for real.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import hasten.utils as U
from hasten.utils import constants

PATHS = {
    "hasten.utils.operations": [
        "recursively_apply", "find_batch_size", "listify", "pad_input_tensors", "convert_outputs_to_fp32",
        "convert_to_fp32", "concatenate", "slice_tensors", "get_data_structure", "initialize_tensors",
        "is_torch_tensor", "is_tensor_information", "honor_type", "is_namedtuple", "find_device",
        "ignorant_find_batch_size", "send_to_device",
    ],
    "hasten.utils.other": [
        "wait_for_everyone", "save", "load", "write_basic_config", "check_os_kernel", "convert_bytes",
        "get_pretty_name", "is_port_in_use", "merge_dicts", "recursive_getattr", "get_model_tp_size",
    ],
    "hasten.utils.random": ["synchronize_rng_state", "synchronize_rng_states", "set_seed"],
    "hasten.utils.environment": [
        "patch_environment", "clear_environment", "str_to_bool", "get_int_from_env", "parse_flag_from_env",
        "parse_choice_from_env", "are_libraries_initialized", "convert_dict_to_env_variables",
        "purge_accelerate_environment",
    ],
    "hasten.utils.versions": ["compare_versions", "is_torch_version"],
    "hasten.utils.tqdm": ["tqdm"],
    "hasten.utils.dataclasses": [
        "PrecisionType", "RNGType", "ComputeEnvironment", "CustomDtype", "SageMakerDistributedType",
        "TensorInformation",
    ],
    "hasten.utils.constants": list(constants.__all__),
}  # fmt: skip

# Accelerate 1.15's values (accelerate/utils/constants.py).
ACCELERATE_CONSTANTS = {
    "SCALER_NAME": "scaler.pt",
    "MODEL_NAME": "pytorch_model",
    "SAFE_MODEL_NAME": "model",
    "RNG_STATE_NAME": "random_states",
    "OPTIMIZER_NAME": "optimizer",
    "SCHEDULER_NAME": "scheduler",
    "SAMPLER_NAME": "sampler",
    "PROFILE_PATTERN_NAME": "profile_{suffix}.json",
    "WEIGHTS_NAME": "pytorch_model.bin",
    "WEIGHTS_PATTERN_NAME": "pytorch_model{suffix}.bin",
    "WEIGHTS_INDEX_NAME": "pytorch_model.bin.index.json",
    "SAFE_WEIGHTS_NAME": "model.safetensors",
    "SAFE_WEIGHTS_PATTERN_NAME": "model{suffix}.safetensors",
    "SAFE_WEIGHTS_INDEX_NAME": "model.safetensors.index.json",
    "FSDP_MODEL_NAME": "pytorch_model_fsdp",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.4.0",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.1.0",
}


# ----------------------------------------------------------------------------- imports


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_name_imports_from_its_path_and_from_hasten_utils(path):
    module = importlib.import_module(path)
    for name in PATHS[path]:
        value = getattr(module, name)
        assert name in module.__all__, (path, name)
        assert getattr(U, name) is value, name
        assert name in U.__all__, name


def test_other_lends_the_model_helpers_of_modeling_lazily():
    names = ["compile_regions", "extract_model_from_parallel", "has_compiled_regions", "is_compiled_module"]
    names.append("model_has_dtensor")
    code = (
        "import sys, hasten.utils.other as o; print('hasten.utils.modeling' in sys.modules); "
        f"import hasten.utils.modeling as m; print(all(getattr(o, n) is getattr(m, n) for n in {names!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]
    other = importlib.import_module("hasten.utils.other")
    assert set(names) <= set(other.__all__) and all(getattr(U, n) is getattr(other, n) for n in names)


def test_top_level_names_are_lazy_and_the_utils_ones():
    import hasten

    assert hasten.find_executable_batch_size is U.find_executable_batch_size
    assert hasten.synchronize_rng_states is U.synchronize_rng_states
    assert {"find_executable_batch_size", "synchronize_rng_states"} <= set(hasten.__all__)
    code = "import hasten, sys; print('torch' in sys.modules, 'hasten.training.rng' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_hasten_utils_stays_cheap_and_tqdm_is_the_function():
    code = (
        "import sys, torch; before = set(sys.modules); import hasten.utils as U; "
        "print(sorted(m for m in set(sys.modules) - before if not m.startswith('hasten'))); "
        "print([m for m in ('hasten.checkpoint', 'hasten.settings.config_file', 'yaml', 'safetensors', 'packaging') "
        "if m in sys.modules]); import hasten.utils.tqdm; U.tqdm; print(callable(U.tqdm))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "[]", "True"], out.stdout
    assert U.tqdm.__module__ == "hasten.utils.tqdm"


def test_constants_are_accelerates_and_what_hasten_writes(tmp_path):
    for name, value in ACCELERATE_CONSTANTS.items():
        assert getattr(constants, name) == value, name
    assert constants.STR_OPERATION_TO_FUNC[">="](2, 1)
    assert torch.nn.Linear in constants.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    from hasten import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.save_model(torch.nn.Linear(2, 2), tmp_path / "safe")
    accelerator.save_model(torch.nn.Linear(2, 2), tmp_path / "bin", safe_serialization=False)
    assert os.listdir(tmp_path / "safe") == [constants.SAFE_WEIGHTS_NAME]
    assert os.listdir(tmp_path / "bin") == [constants.WEIGHTS_NAME]


# ----------------------------------------------------------------------------- enums


def test_enums_have_accelerates_members_and_behaviour():
    from hasten.utils import ComputeEnvironment, CustomDtype, PrecisionType, RNGType, SageMakerDistributedType

    assert PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert PrecisionType.BF16 == "bf16" and str(PrecisionType.FP16) == "fp16" and "fp8" in PrecisionType
    assert "fp32" not in PrecisionType
    assert RNGType.list() == ["torch", "cuda", "mlu", "sdaa", "musa", "npu", "xla", "xpu", "hpu", "neuron", "generator"]
    assert RNGType("cuda") is RNGType.CUDA and str(RNGType.GENERATOR) == "generator" and "xla" in RNGType
    assert RNGType.TORCH != "torch"  # not a str enum, as in Accelerate
    assert ComputeEnvironment("LOCAL_MACHINE") == "LOCAL_MACHINE"
    assert [m.value for m in SageMakerDistributedType] == ["NO", "DATA_PARALLEL", "MODEL_PARALLEL"]
    assert [m.value for m in CustomDtype] == ["fp8", "int4", "int2"]
    from hasten import Accelerator

    assert Accelerator(cpu=True, mixed_precision=PrecisionType.BF16).mixed_precision == "bf16"


# ----------------------------------------------------------------------------- operations

Pair = collections.namedtuple("Pair", ["x", "y"])


def test_recursively_apply_is_accelerates():
    data = {"a": [torch.ones(2), (torch.zeros(1), "s")], "p": Pair(torch.ones(3), 4)}
    out = U.recursively_apply(lambda t, k, scale: t * k + scale, data, 2, scale=1)
    assert out["a"][0].tolist() == [3.0, 3.0] and out["a"][1][1] == "s" and isinstance(out["a"][1], tuple)
    assert isinstance(out["p"], Pair) and out["p"].y == 4 and out["p"].x.tolist() == [3.0] * 3
    ordered = collections.OrderedDict(b=torch.ones(1))
    assert type(U.recursively_apply(lambda t: t, ordered)) is collections.OrderedDict
    assert U.recursively_apply(len, ["ab", 3], test_type=lambda x: isinstance(x, str)) == [2, 3]
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\) passed to `neg`"):
        U.recursively_apply(torch.neg, [torch.ones(1), "no"], error_on_other_type=True)


def test_batch_size_listify_structure_and_slices():
    batch = {"ids": torch.arange(6).view(3, 2), "mask": [torch.ones(3)]}
    assert U.find_batch_size(batch) == 3 and U.find_batch_size([torch.ones(5, 2)]) == 5
    with pytest.raises(ValueError, match="empty"):
        U.find_batch_size({})
    with pytest.raises(TypeError, match="Can only find the batch size of tensors"):
        U.find_batch_size(["text"])
    assert U.ignorant_find_batch_size(["text"]) is None
    assert U.listify({"a": torch.tensor([1.5], dtype=torch.bfloat16), "b": (torch.tensor(2),)}) == {
        "a": [1.5],
        "b": (2,),
    }
    info = U.get_data_structure(batch)
    assert U.is_tensor_information(info["ids"]) and info["ids"].shape == (3, 2) and info["ids"].dtype == torch.int64
    fresh = U.initialize_tensors(info)
    assert fresh["ids"].shape == (3, 2) and fresh["mask"][0].dtype == torch.float32
    assert U.slice_tensors(batch, slice(1, 3))["ids"].tolist() == [[2, 3], [4, 5]]
    both = U.concatenate([batch, batch])
    assert both["ids"].shape == (6, 2) and both["mask"][0].shape == (6,)
    assert U.concatenate([Pair(torch.ones(1, 1), torch.ones(2, 1))] * 2, dim=1).y.shape == (2, 2)
    assert U.concatenate(["only"]) == "only"
    with pytest.raises(ValueError, match="concatenate.data must be a non-empty list"):
        U.concatenate([])
    assert U.honor_type(Pair(1, 2), iter([5, 6])) == Pair(5, 6) and U.is_namedtuple(Pair(1, 2))
    assert not U.is_namedtuple((1, 2)) and U.is_torch_tensor(torch.ones(1)) and not U.is_torch_tensor([1])
    assert U.find_device({"a": [1, torch.ones(1)]}) == torch.device("cpu") and U.find_device([1]) is None


@pytest.mark.parametrize(
    ("batch_size", "num_processes", "rows"),
    [(1, 2, 2), (3, 2, 4), (4, 3, 6), (3, 4, 4), (4, 6, 6), (1, 6, 6), (9, 4, 12)],  # Accelerate's test cases, then one
)
def test_pad_input_tensors(batch_size, num_processes, rows):
    batch = torch.rand(batch_size, 4, 4)
    out = U.pad_input_tensors({"x": batch, "y": [batch[:, 0]]}, batch_size, num_processes)
    assert out["x"].shape == (rows, 4, 4) and out["y"][0].shape == (rows, 4)
    assert torch.equal(out["x"][:batch_size], batch) and not out["x"][batch_size:].any()


def test_pad_input_tensors_along_a_dim_and_refusals():
    assert U.pad_input_tensors(torch.ones(2, 3), 3, 2, dim=1).shape == (2, 4)
    same = torch.ones(4, 1)
    assert U.pad_input_tensors(same, 4, 2) is same
    with pytest.raises(ValueError, match=r"pad_input_tensors.num_processes must be >= 1, got 0"):
        U.pad_input_tensors(same, 4, 0)
    with pytest.raises(ValueError, match="more than batch_size=2"):
        U.pad_input_tensors(same, 2, 2)
    with pytest.raises(TypeError, match="Unsupported types"):
        U.pad_input_tensors([same, "text"], 4, 2)


def test_convert_outputs_to_fp32():
    def forward(x):
        return {"h": x.half(), "b": (x.bfloat16(), x.long())}

    wrapped = U.convert_outputs_to_fp32(forward)
    out = wrapped(torch.ones(2))
    assert out["h"].dtype == torch.float32 and out["b"][0].dtype == torch.float32 and out["b"][1].dtype == torch.int64
    assert wrapped.__wrapped__.__wrapped__ is forward
    with pytest.raises(pickle.PicklingError, match="unwrap the model"):
        pickle.dumps(wrapped.__wrapped__)
    assert U.convert_to_fp32([torch.ones(1, dtype=torch.float16)])[0].dtype == torch.float32
    with pytest.raises(TypeError, match="convert_outputs_to_fp32.model_forward must be a callable"):
        U.convert_outputs_to_fp32(3)


# ----------------------------------------------------------------------------- environment, versions, tqdm


def test_patch_environment(monkeypatch):
    monkeypatch.setenv("HASTEN_T41_OLD", "before")
    monkeypatch.delenv("HASTEN_T41_NEW", raising=False)
    with U.patch_environment(hasten_t41_old=1, HASTEN_T41_NEW=2.5):
        assert os.environ["HASTEN_T41_OLD"] == "1" and os.environ["HASTEN_T41_NEW"] == "2.5"
    assert os.environ["HASTEN_T41_OLD"] == "before" and "HASTEN_T41_NEW" not in os.environ
    with pytest.raises(ValueError, match="cannot be an environment variable's name"):
        with U.patch_environment(HASTEN_T41_NEW="x", **{"A=B": "y"}):
            pass  # pragma: no cover
    assert "HASTEN_T41_NEW" not in os.environ  # a refused call sets nothing


def test_clear_environment(monkeypatch):
    monkeypatch.setenv("HASTEN_T41_KEPT", "kept")
    before = dict(os.environ)
    with U.clear_environment():
        assert dict(os.environ) == {}
        os.environ["HASTEN_T41_INSIDE"] = "x"
    assert dict(os.environ) == before


def test_environment_readers(monkeypatch):
    assert U.str_to_bool("Yes") == 1 and U.str_to_bool("off", to_bool=True) is False
    with pytest.raises(ValueError, match="invalid truth value 'maybe'"):
        U.str_to_bool("maybe")
    monkeypatch.setenv("HASTEN_T41_FLAG", "true")
    monkeypatch.setenv("HASTEN_T41_INT", "7")
    assert U.parse_flag_from_env("HASTEN_T41_FLAG") and not U.parse_flag_from_env("HASTEN_T41_UNSET")
    assert U.get_int_from_env(["HASTEN_T41_UNSET", "HASTEN_T41_INT"], 3) == 7
    assert U.get_int_from_env(["HASTEN_T41_UNSET"], 3) == 3
    assert U.parse_choice_from_env("HASTEN_T41_UNSET", "bf16") == "bf16"
    assert U.are_libraries_initialized("torch", "surely_not_a_module") == ["torch"]


def test_convert_dict_to_env_variables(caplog):
    lines = U.convert_dict_to_env_variables({"ACCELERATE_DEBUG_MODE": "1", "BAD": "<x", "EMPTY": "", "OTHER": "2"})
    assert lines == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER=2\n"]
    assert "Skipping BAD=<x" in caplog.text and "Skipping EMPTY=" in caplog.text


def test_purge_accelerate_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_T41_OLD", "before")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    @U.purge_accelerate_environment
    def sets_them():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCELERATE_T41_OLD"] = "changed"
        return "done"

    assert sets_them() == "done"
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ and os.environ["ACCELERATE_T41_OLD"] == "before"

    @U.purge_accelerate_environment
    class Base:
        def test_one(self):
            os.environ["ACCELERATE_T41_NEW"] = "1"

    class Child(Base):
        def test_two(self):
            del os.environ["ACCELERATE_T41_OLD"]

    Child().test_one()
    Child().test_two()
    assert "ACCELERATE_T41_NEW" not in os.environ and os.environ["ACCELERATE_T41_OLD"] == "before"


def test_small_helpers():
    assert U.get_pretty_name(U.save) == "save" and U.get_pretty_name(torch.nn.Linear(1, 1)) == "Linear"
    assert U.merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}}) == {"a": {"d": 3, "b": 1}, "c": 2}
    assert U.convert_bytes(1536) == "1.5 KB" and U.convert_bytes(10) == "10 bytes"
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    assert U.recursive_getattr(model, "0.weight") is model[0].weight
    assert U.get_model_tp_size(model) is None
    model.config = type("Config", (), {"distributed_config": {"tp_size": 2}})()
    assert U.get_model_tp_size(model) == 2
    model.tp_size = 4
    assert U.get_model_tp_size(model) == 4
    from launch_utils import free_port

    assert not U.is_port_in_use(free_port())


def test_versions():
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    torch_version = Version(version("torch"))
    assert U.is_torch_version(">=", "2.4") and not U.is_torch_version("<", "2.0")
    assert U.is_torch_version("==", str(torch_version))
    assert U.compare_versions("torch", "!=", "1.0") and U.compare_versions(Version("1.2"), "<", "1.10")
    with pytest.raises(ValueError, match=r"compare_versions.operation must be one of '>'"):
        U.compare_versions("torch", "=>", "2.0")
    with pytest.raises(PackageNotFoundError, match="'surely-not-installed' is not an installed distribution"):
        U.compare_versions("surely-not-installed", ">", "1.0")


def test_tqdm_shows_on_the_local_main_process_only(monkeypatch):
    pytest.importorskip("tqdm")
    assert not U.tqdm(range(2), disable=False).disable
    assert U.tqdm(range(2), disable=True).disable
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert U.tqdm(range(2)).disable
    assert not U.tqdm(range(2), main_process_only=False).disable
    with pytest.raises(ValueError, match="main_process_only"):
        U.tqdm(True, range(2))


# ----------------------------------------------------------------------------- save, load, config, processes


def test_save_and_load(tmp_path, caplog):
    U.save({"w": torch.arange(3)}, tmp_path / "a.bin")
    assert torch.equal(U.load(tmp_path / "a.bin")["w"], torch.arange(3))
    tied = torch.ones(2)
    with caplog.at_level("WARNING"):
        U.save({"a": tied, "b": tied}, tmp_path / "m.safetensors", safe_serialization=True)
    # As Accelerate's: one warning names what a reader other than hasten's will not see.
    assert [r.getMessage()[:44] for r in caplog.records] == ["save: Removed shared tensor ['b'] while savi"]
    assert "b -> a" in caplog.records[0].getMessage()
    safetensors = pytest.importorskip("safetensors.torch")
    stored = safetensors.load_file(tmp_path / "m.safetensors")
    assert list(stored) == ["a"] and torch.equal(stored["a"], tied)  # tied tensors stored once, as Accelerate's
    with pytest.raises(TypeError, match="save.save_on_each_node must be True or False"):
        U.save({}, tmp_path / "x.bin", save_on_each_node="yes")
    assert not (tmp_path / "x.bin").exists()


def test_load_reads_numpy_random_states_and_runs_nothing(tmp_path):
    np = pytest.importorskip("numpy")
    torch.save({"numpy": np.random.get_state(), "torch": torch.get_rng_state()}, tmp_path / "rng.pkl")
    state = U.load(tmp_path / "rng.pkl")
    assert state["numpy"][0] == "MT19937" and torch.equal(state["torch"], torch.get_rng_state())
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save(Payload(), tmp_path / "evil.pkl")
    from hasten.checkpoint.errors import UnsafeCheckpoint

    with pytest.raises(UnsafeCheckpoint, match="'posix.mkdir'"):
        U.load(tmp_path / "evil.pkl")
    assert not marker.exists()
    U.load(tmp_path / "evil.pkl", weights_only=False)  # a file the caller trusts
    assert marker.exists()


def test_save_writes_on_the_main_process_only(tmp_path, monkeypatch):
    import torch.distributed as dist

    barriers = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1))
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 1, the main process of its machine
    U.save({"w": torch.ones(1)}, tmp_path / "main_only.bin")
    U.save({"w": torch.ones(1)}, tmp_path / "each_node.bin", save_on_each_node=True)
    assert sorted(os.listdir(tmp_path)) == ["each_node.bin"]
    U.wait_for_everyone()
    assert barriers == [1]


def test_write_basic_config(tmp_path, monkeypatch):
    pytest.importorskip("yaml")
    from hasten.settings.config_file import load_config

    target = tmp_path / "sub" / "config.yaml"
    assert U.write_basic_config("BF16", save_location=target) == target
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert load_config(target).launch == {"num_processes": max(gpus, 1), "cpu": gpus == 0, "mixed_precision": "bf16"}
    text = target.read_text()
    assert U.write_basic_config("fp16", save_location=target) is False and target.read_text() == text
    with pytest.raises(ValueError, match=r"write_basic_config.mixed_precision must be one of 'no', 'fp16'.*got 'fp32'"):
        U.write_basic_config("fp32", save_location=tmp_path / "other.yaml")
    assert not (tmp_path / "other.yaml").exists()
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "home"))
    assert U.write_basic_config() == tmp_path / "home" / "default_config.yaml"
    assert load_config(tmp_path / "home" / "default_config.yaml").launch["mixed_precision"] == "no"


def test_synchronize_rng_state_on_one_process():
    from hasten.utils import RNGType

    torch.manual_seed(3)
    state = torch.get_rng_state()
    U.synchronize_rng_state(RNGType.TORCH)
    U.synchronize_rng_state("generator", generator=torch.Generator())
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="synchronize_rng_state.rng_type is required"):
        U.synchronize_rng_state()
    with pytest.raises(ValueError, match=r"rng_type='xla': the XLA device's generator is not one hasten runs"):
        U.synchronize_rng_state(RNGType.XLA)
    with pytest.raises(ValueError, match="needs generator=torch.Generator()"):
        U.synchronize_rng_state(RNGType.GENERATOR)


_TWO_PROCESSES = """
    import json, os, sys, torch
    import torch.distributed as dist
    from hasten.utils import RNGType, load, save, synchronize_rng_state, wait_for_everyone

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # different states before
    differ = torch.rand(1).item()
    save({"rank": torch.tensor(rank)}, os.path.join(out, "saved.bin"))
    wait_for_everyone()  # joins the group (as PartialState() would) and waits for rank 0's file
    seen = int(load(os.path.join(out, "saved.bin"))["rank"])
    synchronize_rng_state(RNGType.TORCH)
    same = torch.rand(1).item()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"differ": differ, "same": same, "seen": seen, "world": dist.get_world_size()}, f)
"""


def test_on_two_processes(tmp_path):
    from launch_utils import free_port, launch, read_ranks

    script = tmp_path / "utils4_two.py"
    script.write_text(textwrap.dedent(_TWO_PROCESSES))
    out = tmp_path / "out"
    out.mkdir()
    proc = launch("--num_processes", "2", "--main_process_port", free_port(), "--cpu", script, out, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = read_ranks(out, 2)
    assert r0["world"] == r1["world"] == 2
    assert r0["seen"] == r1["seen"] == 0  # only the main process wrote the file
    assert r0["differ"] != r1["differ"] and r0["same"] == r1["same"]
    assert json.loads((out / "rank0.json").read_text()) == r0
