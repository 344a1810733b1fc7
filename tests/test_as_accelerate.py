"""hasten.install_as_accelerate(): ``import accelerate...`` answered by hasten's own modules (issue 58).

The hook is process-wide (and the real accelerate may be imported by other tests of this
process), so every check of it runs in a fresh interpreter. The Trainer comparisons run the same
script under the real Accelerate (the ``parity`` pin) and under the hook: the losses must agree
to 1e-6 (they are bit-identical).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch_utils import SCRIPTS, free_port, launch, launch_env, read_ranks

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_accelerate = pytest.mark.skipif(not HAS_ACCELERATE, reason="the real accelerate is not installed (test extra)")
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (test extra)")


def _python(code: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    environ = launch_env(HF_HUB_OFFLINE="1", **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True, timeout=timeout
    )


def _ok(code: str, **kwargs: object) -> str:
    proc = _python(code, **kwargs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_accelerate_is_hasten_same_objects_version_and_metadata():
    out = _ok(
        """
        import importlib, importlib.metadata, importlib.util, sys
        import hasten
        hasten.install_as_accelerate()
        hasten.install_as_accelerate()  # twice: nothing more
        from hasten.compat.as_accelerate import ACCELERATE_VERSION, _finder
        assert sys.meta_path[0] is _finder and sys.meta_path.count(_finder) == 1
        assert importlib.util.find_spec("accelerate") is not None
        import accelerate
        assert accelerate.__version__ == ACCELERATE_VERSION, accelerate.__version__
        assert importlib.metadata.version("accelerate") == ACCELERATE_VERSION
        assert importlib.metadata.distribution("accelerate").metadata["Name"] == "accelerate"
        from accelerate import Accelerator, PartialState
        from accelerate.utils import tqdm
        import accelerate.utils, accelerate.utils.modeling, accelerate.state, accelerate.hooks
        assert Accelerator is hasten.Accelerator and PartialState is hasten.PartialState
        assert sys.modules["accelerate.utils"] is hasten.utils
        assert accelerate.utils is hasten.utils and accelerate.utils.modeling is hasten.utils.modeling
        assert sys.modules["accelerate.hooks"] is importlib.import_module("hasten.hooks")
        # hasten's modules keep their own spec; a name the package binds stays bound (tqdm, a function)
        assert hasten.utils.__spec__.name == "hasten.utils" and hasten.utils.__name__ == "hasten.utils"
        import accelerate.utils.tqdm
        assert callable(hasten.utils.tqdm) and not isinstance(hasten.utils.tqdm, type(sys))
        assert isinstance(accelerate.Accelerator(cpu=True), hasten.Accelerator)
        try:
            import accelerate.no_such_module
        except ModuleNotFoundError as err:
            assert err.name == "accelerate.no_such_module", err.name
            assert "accelerate.no_such_module" in str(err)
        else:
            raise AssertionError("a module hasten lacks imported")
        assert importlib.util.find_spec("accelerate.no_such_module") is None
        print("OK")
        """
    )
    assert out.strip().endswith("OK")


def test_without_install_nothing_changes():
    _ok(
        """
        import importlib.util, sys
        import hasten, hasten.utils, hasten.compat.as_accelerate as hook
        assert not hook.is_installed() and not any(isinstance(f, hook.AccelerateFinder) for f in sys.meta_path)
        spec = importlib.util.find_spec("accelerate")
        assert spec is None or "hasten" not in str(spec.origin), spec
        """
    )


@needs_accelerate
def test_install_after_real_accelerate_is_refused_naming_the_modules():
    proc = _python(
        """
        import sys
        import accelerate.utils
        import hasten
        try:
            hasten.install_as_accelerate()
        except RuntimeError as err:
            print("REFUSED", err)
        from hasten.compat.as_accelerate import is_installed
        assert not is_installed() and type(sys.modules["accelerate"]).__name__ == "module"
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "before accelerate is imported" in proc.stdout, proc.stdout
    assert "(accelerate, accelerate.accelerator, " in proc.stdout and " more)" in proc.stdout


# What transformers 5.25, TRL 1.16, PEFT 0.21 and diffusers 0.42 import from accelerate at module
# level (found by walking their sources' imports): each must exist at Accelerate's path.
CENSUS = {
    "accelerate": "Accelerator ParallelismConfig PartialState FullyShardedDataParallelPlugin cpu_offload "
    "cpu_offload_with_hook dispatch_model infer_auto_device_map init_empty_weights skip_first_batches",
    "accelerate.big_modeling": "check_device_map",
    "accelerate.commands.config": "default_config_file load_config_from_file",
    "accelerate.commands.launch": "launch_command launch_command_parser",
    "accelerate.hooks": "AlignDevicesHook CpuOffload ModelHook add_hook_to_module remove_hook_from_module "
    "remove_hook_from_submodules",
    "accelerate.logging": "get_logger",
    "accelerate.parallelism_config": "ParallelismConfig",
    "accelerate.state": "AcceleratorState PartialState GradientState is_initialized",
    "accelerate.utils": "CustomDtype DataLoaderConfiguration DeepSpeedPlugin DeepSpeedSchedulerWrapper "
    "DistributedDataParallelKwargs DistributedType DummyOptim DummyScheduler FullyShardedDataParallelPlugin "
    "GradientAccumulationPlugin TorchDynamoPlugin broadcast_object_list compute_module_sizes "
    "extract_model_from_parallel find_executable_batch_size gather gather_object get_balanced_memory "
    "get_max_memory infer_auto_device_map is_mlu_available is_npu_available is_peft_model is_wandb_available "
    "is_xpu_available load_fsdp_model load_fsdp_optimizer load_offloaded_weights named_module_tensors "
    "offload_state_dict offload_weight reduce release_memory save_fsdp_model save_fsdp_optimizer "
    "save_offload_index send_to_device set_module_tensor_to_device set_seed tqdm",
    "accelerate.utils.constants": "FSDP_AUTO_WRAP_POLICY FSDP_SHARDING_STRATEGY",
    "accelerate.utils.dataclasses": "get_module_class_from_name",
    "accelerate.utils.deepspeed": "HfDeepSpeedConfig",
    "accelerate.utils.fsdp_utils": "get_parameters_from_modules",
    "accelerate.utils.imports": "is_bf16_available is_fp8_available is_xpu_available",
    "accelerate.utils.memory": "clear_device_cache release_memory should_reduce_batch_size",
    "accelerate.utils.modeling": "clean_device_map convert_file_size_to_int get_max_layer_size",
    "accelerate.utils.versions": "is_torch_version",
}


def test_every_name_the_hf_libraries_import_exists_at_accelerates_path():
    out = _ok(
        f"""
        import importlib
        import hasten
        hasten.install_as_accelerate()
        missing = []
        for module, names in {CENSUS!r}.items():
            m = importlib.import_module(module)
            missing += [f"{{module}}.{{n}}" for n in names.split() if not hasattr(m, n)]
        print("MISSING", missing)
        """
    )
    assert "MISSING []" in out, out


@needs_transformers
@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_transformers_trainer_imports_under_the_hook():
    """transformers' Trainer (and TRL, PEFT where installed) import with every accelerate module hasten's."""
    libraries = [lib for lib in ("trl", "peft") if importlib.util.find_spec(lib) is not None]
    out = _ok(
        f"""
        import importlib, sys
        import hasten
        hasten.install_as_accelerate()
        import transformers
        from transformers import Trainer, TrainingArguments, AutoModelForCausalLM
        import transformers.trainer
        from transformers.utils import is_accelerate_available
        assert is_accelerate_available()
        for lib in {libraries!r}:
            importlib.import_module(lib)
        from trl import SFTTrainer, DPOTrainer  # noqa: F401 - their modules import accelerate's names
        loaded = [n for n, m in sys.modules.items() if n.startswith("accelerate") and m is not None]
        foreign = [n for n in loaded if n != "accelerate" and not sys.modules[n].__name__.startswith("hasten")]
        print("FOREIGN", foreign, len(loaded))
        """.replace(
            "        from trl import SFTTrainer, DPOTrainer  # noqa: F401 - their modules import accelerate's names\n",
            "        from trl import SFTTrainer, DPOTrainer  # noqa: F401\n" if "trl" in libraries else "",
        ),
        timeout=280,
    )
    assert "FOREIGN []" in out, out


# ------------------------------------------------------------------ behaviours the libraries rely on


def _accelerate_module(name: str):
    """The real Accelerate's module (this process never installs the hook)."""
    return importlib.import_module(name)


def test_hooks_add_replace_append_remove_as_accelerate():
    from hasten.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_submodules

    calls = []

    class Scale(ModelHook):
        def __init__(self, by):
            self.by = by

        def pre_forward(self, module, *args, **kwargs):
            calls.append(("pre", self.by))
            return (args[0] * self.by,), kwargs

        def post_forward(self, module, output):
            calls.append(("post", self.by))
            return output + self.by

    layer = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    plain = layer(x)
    original = layer.forward
    add_hook_to_module(layer, Scale(2.0))
    assert torch.equal(layer(x), layer._old_forward(x * 2) + 2) and layer._old_forward == original
    add_hook_to_module(layer, Scale(3.0))  # replaces
    assert torch.equal(layer(x), original(x * 3) + 3)
    add_hook_to_module(layer, Scale(5.0), append=True)  # chains after
    assert isinstance(layer._hf_hook, SequentialHook)
    calls.clear()
    assert torch.equal(layer(x), original(x * 15) + 8)
    assert calls == [("pre", 3.0), ("pre", 5.0), ("post", 3.0), ("post", 5.0)]
    model = torch.nn.Sequential(layer)
    remove_hook_from_submodules(model)
    assert not hasattr(layer, "_hf_hook") and not hasattr(layer, "_old_forward") and torch.equal(layer(x), plain)
    with pytest.raises(TypeError, match="hook must be a ModelHook"):
        add_hook_to_module(layer, object())


@needs_accelerate
def test_hooks_and_helpers_match_accelerates():
    import hasten.big_modeling
    import hasten.hooks
    import hasten.utils.dataclasses
    import hasten.utils.fsdp_utils
    from hasten.utils.modeling import clean_device_map

    theirs = _accelerate_module("accelerate.hooks")

    class Add(theirs.ModelHook):
        no_grad = True

        def post_forward(self, module, output):
            return output + 1

    class Mine(hasten.hooks.ModelHook):
        no_grad = True

        def post_forward(self, module, output):
            return output + 1

    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, requires_grad=True)
    theirs.add_hook_to_module(a, Add())
    hasten.hooks.add_hook_to_module(b, Mine())
    ya, yb = a(x), b(x)
    assert torch.equal(ya, yb) and ya.requires_grad == yb.requires_grad is False  # no_grad honoured by both
    assert sorted(k for k in vars(a) if k.startswith("_hf") or k == "_old_forward") == sorted(
        k for k in vars(b) if k.startswith("_hf") or k == "_old_forward"
    )
    for fn in ("dispatch_model", "cpu_offload", "cpu_offload_with_hook", "disk_offload"):
        ours, real = (
            inspect.signature(getattr(hasten.big_modeling, fn)),
            inspect.signature(getattr(_accelerate_module("accelerate.big_modeling"), fn)),
        )
        assert list(ours.parameters) == list(real.parameters), fn
    device_map = {"a.0": 0, "a.1": 0, "b.x": "cpu", "b.y": 0, "c": "disk"}
    real_map = _accelerate_module("accelerate.utils.modeling").clean_device_map(dict(device_map))
    assert clean_device_map(dict(device_map)) == real_map == {"a": 0, "b.x": "cpu", "b.y": 0, "c": "disk"}
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 1)))
    real_get = _accelerate_module("accelerate.utils.dataclasses").get_module_class_from_name
    for name in ("ReLU", "Linear", "Sequential", "Conv2d"):
        assert hasten.utils.dataclasses.get_module_class_from_name(model, name) is real_get(model, name)
    real_params = _accelerate_module("accelerate.utils.fsdp_utils").get_parameters_from_modules
    for spec in (r"1\.1", "0|1.1", [model[0]], None):
        ours = hasten.utils.fsdp_utils.get_parameters_from_modules(spec, model, None)
        assert {id(p) for p in ours} == {id(p) for p in real_params(spec, model, None)}


def test_state_behaviours_the_trainer_uses(monkeypatch):
    from datetime import timedelta

    from hasten import Accelerator
    from hasten.settings.plugins import GradientAccumulationPlugin
    from hasten.state import AcceleratorState, PartialState, is_initialized

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    state = PartialState(cpu=True, backend="gloo", timeout=timedelta(seconds=60))  # TrainingArguments' call
    assert state.num_processes == 1 and state.device.type == "cpu"
    with pytest.raises(ValueError, match="backend must be one of"):
        PartialState(cpu=True, backend="no-such-backend")
    with pytest.raises(TypeError, match="not both"):
        PartialState(cpu=True, backend="gloo", init_handler=hasten_init_handler())
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not is_initialized()
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    assert is_initialized()
    gs = acc.gradient_state
    assert gs.plugin_kwargs == {"num_steps": 2, "sync_each_batch": True}
    gs._set_sync_gradients(False)
    assert gs.sync_gradients is False and acc.sync_gradients is False
    gs._set_sync_gradients(True)
    assert acc.sync_gradients is True
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not is_initialized()


def hasten_init_handler():
    from hasten import InitProcessGroupKwargs

    return InitProcessGroupKwargs(backend="gloo")


@needs_accelerate
def test_plugin_kwargs_as_accelerates():
    real = _accelerate_module("accelerate.utils").GradientAccumulationPlugin
    from hasten.distributed.state import LoopState

    for kwargs in (
        {"num_steps": 1},
        {"num_steps": 4, "sync_with_dataloader": False},
        {"num_steps": 2, "sync_each_batch": True},
    ):
        assert LoopState(**kwargs).plugin_kwargs == real(**kwargs).to_kwargs(), kwargs


def test_commands_config_reads_a_file(tmp_path):
    from hasten.commands.config import default_config_file, load_config_from_file

    assert isinstance(default_config_file, str) and default_config_file.endswith(".yaml")
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\nmixed_precision: bf16\n")
    cfg = load_config_from_file(str(path))
    assert cfg.to_dict() == {"num_processes": 2, "mixed_precision": "bf16"} and cfg.num_processes == 2
    path.write_text("num_processes: two\n")
    with pytest.raises(TypeError, match="line 1: num_processes must be an integer"):
        load_config_from_file(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_config_from_file(str(tmp_path / "missing.yaml"))


@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_commands_launch_parses_then_launches_under_the_hook(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _ok(
        f"""
        import hasten
        hasten.install_as_accelerate()
        from accelerate.commands.launch import launch_command, launch_command_parser
        args = launch_command_parser().parse_args(["--num_processes", "2", "--cpu", "--main_process_port",
            "{free_port()}", {str(SCRIPTS / "as_accelerate_probe.py")!r}, {str(out)!r}])
        assert args.num_processes == 2 and args.training_script.endswith("as_accelerate_probe.py")
        assert args.training_script_args == [{str(out)!r}]
        launch_command(args)
        try:
            launch_command_parser().parse_args(["--num_processes", "zero", "x.py"])
        except SystemExit as err:
            assert err.code == 2
        else:
            raise AssertionError("a bad flag parsed")
        """,
        timeout=280,
    )
    ranks = read_ranks(out, 2)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["installed"] and r["same_utils"] for r in ranks)


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_launch_as_accelerate_installs_in_every_process(tmp_path, processes):
    proc = launch(
        "--as_accelerate", "--cpu", "--num_processes", str(processes), "--main_process_port", str(free_port()),
        SCRIPTS / "as_accelerate_probe.py", tmp_path, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(tmp_path, processes)
    for rank, facts in enumerate(ranks):
        assert facts["rank"] == rank and facts["world"] == processes
        assert facts["installed"] and facts["same_accelerator"] and facts["same_utils"], facts
        assert facts["version"] == facts["metadata_version"] == "1.15.0"
        assert facts["main"] == "__main__" and facts["argv"] == [str(tmp_path)]


def test_launch_without_the_flag_installs_nothing(tmp_path):
    proc = launch("--cpu", "--num_processes", "1", SCRIPTS / "as_accelerate_probe.py", tmp_path, timeout=240)
    # the script imports accelerate: without the flag it is the real one, or none at all
    if HAS_ACCELERATE:
        assert proc.returncode == 0, proc.stderr
        assert read_ranks(tmp_path, 1)[0]["installed"] is False
    else:
        assert proc.returncode != 0 and "No module named 'accelerate'" in proc.stderr


def test_config_file_key_as_accelerate(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("as_accelerate: true\ncpu: true\nnum_processes: 1\n")
    proc = launch("--config_file", config, SCRIPTS / "as_accelerate_probe.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_ranks(tmp_path, 1)[0]["installed"] is True


def test_pins_agree():
    """One Accelerate version: the one the hook reports is the one the tests compare against."""
    import tomllib

    from hasten.compat.as_accelerate import ACCELERATE_VERSION

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {req for extra in ("parity", "test") for req in extras[extra] if req.startswith("accelerate")}
    assert pins == {f"accelerate=={ACCELERATE_VERSION}"}, pins


# ------------------------------------------------------------------ the Trainer, both ways


def _trainer_result(folder: Path) -> dict:
    return json.loads((folder / "result.json").read_text())


def _assert_same_training(ours: dict, theirs: dict, world: int) -> None:
    assert ours["accelerate"] == "hasten.accelerator" and theirs["accelerate"] == "accelerate.accelerator"
    assert ours["world"] == theirs["world"] == world
    assert len(ours["losses"]) == len(theirs["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-6, (ours, theirs)
    assert max(abs(a - b) for a, b in zip(ours["evals"], theirs["evals"])) <= 1e-6
    assert ours["saved"] == theirs["saved"]


@needs_transformers
@needs_accelerate
@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_trainer_losses_equal_accelerates_one_process(tmp_path):
    script = str(SCRIPTS / "as_accelerate_trainer.py")
    env = launch_env(HF_HUB_OFFLINE="1")
    runs = {
        mode: subprocess.Popen(
            [sys.executable, script, mode, str(tmp_path / mode)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for mode in ("plain", "install")
    }
    for mode, proc in runs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"{mode}: {output[-4000:]}"
    _assert_same_training(_trainer_result(tmp_path / "install"), _trainer_result(tmp_path / "plain"), world=1)


@pytest.mark.slow
@needs_transformers
@needs_accelerate
def test_trainer_losses_equal_accelerates_two_processes(tmp_path):
    """hasten launch --as_accelerate (an unmodified script) against torchrun on Accelerate."""
    script = SCRIPTS / "as_accelerate_trainer.py"
    proc = launch(
        "--as_accelerate", "--cpu", "--num_processes", "2", "--main_process_port", str(free_port()),
        script, "plain", tmp_path / "hasten", timeout=400, env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    real = subprocess.run(
        [*torchrun, "--master_port", str(free_port()), str(script), "plain", str(tmp_path / "accelerate")],
        env=launch_env(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert real.returncode == 0, real.stderr[-4000:]
    _assert_same_training(_trainer_result(tmp_path / "hasten"), _trainer_result(tmp_path / "accelerate"), world=2)


def test_no_torch_in_the_hook_or_the_child():
    """The launcher and its worker wrapper import the hook without torch (it loads with the script)."""
    _ok(
        """
        import sys
        import hasten.compat.as_accelerate, hasten.cli._child, hasten.commands
        assert "torch" not in sys.modules, [m for m in sys.modules if m.startswith("torch")][:3]
        """
    )
