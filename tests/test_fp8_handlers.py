"""The fp8 recipe handlers' settings surface (issue 42): AORecipeKwargs, TERecipeKwargs,
MSAMPRecipeKwargs and FP8RecipeKwargs (fields, defaults, ACCELERATE_FP8_* variables, checks),
their resolution next to mixed_precision, the config file's fp8_config section and the launcher's
--mixed_precision fp8 / --fp8_* flags."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import warnings

import pytest

from hasten.settings import config_file as config
from hasten.settings import environment
from hasten.settings.choices import MIXED_PRECISION_CHOICES, FP8BackendType
from hasten.settings.launch_settings import LAUNCH_SETTINGS, parse_setting_text, setting_variables
from hasten.settings.recipes import (
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
    fp8_backend_from_env,
)
from hasten.settings.resolve import EVEN_BATCHES_DEFAULT, SPLIT_BATCHES_DEFAULT, resolve
from launch_utils import launch, launch_env

FP8_VARIABLES = [n for n in vars(environment) if n.startswith("ACCELERATE_FP8_")]
HAS_MSAMP = importlib.util.find_spec("msamp") is not None


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    for name in (*FP8_VARIABLES, "HASTEN_MIXED_PRECISION", "HASTEN_CONFIG_FILE", "HASTEN_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    for name in ("ACCELERATE_USE_FSDP", "HASTEN_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "home"))


def _float8():
    return pytest.importorskip("torchao.float8")


def no_warning_construct(cls, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return cls(**kwargs)


# ----------------------------------------------------------------------------- defaults


def test_defaults_are_accelerates():
    te = TERecipeKwargs()
    assert dataclasses.asdict(te) == {
        "use_autocast_during_eval": False,
        "margin": 0,
        "interval": 1,
        "fp8_format": "HYBRID",
        "amax_history_len": 1024,
        "amax_compute_algo": "most_recent",
        "override_linear_precision": (False, False, False),
        "use_mxfp8_block_scaling": False,
    }
    assert MSAMPRecipeKwargs().opt_level == "O2"
    ao = AORecipeKwargs()
    assert (ao.pad_inner_dim, ao.enable_fsdp_float8_all_gather, ao.module_filter_func) == (True, True, None)
    fp8 = no_warning_construct(FP8RecipeKwargs)
    assert fp8.backend == ("MSAMP" if HAS_MSAMP else "TE") and fp8.opt_level == "O2" and fp8.margin == 0
    # Accelerate's field order (FP8RecipeKwargs: MSAMP's, TE's, then backend)
    assert [f.name for f in dataclasses.fields(FP8RecipeKwargs)][:2] == ["opt_level", "use_autocast_during_eval"]
    assert [f.name for f in dataclasses.fields(FP8RecipeKwargs)][-1] == "backend"


def test_ao_builds_torchaos_config():
    float8 = _float8()
    ao = AORecipeKwargs()
    assert isinstance(ao.config, float8.Float8LinearConfig)
    assert ao.config.pad_inner_dim is True and ao.config.enable_fsdp_float8_all_gather is True
    off = AORecipeKwargs(pad_inner_dim=False, enable_fsdp_float8_all_gather=False)
    assert off.config.pad_inner_dim is False and off.config.enable_fsdp_float8_all_gather is False
    mine = float8.Float8LinearConfig(pad_inner_dim=False)
    given = AORecipeKwargs(config=mine, module_filter_func=lambda module, name: True)
    assert given.config is mine and given.pad_inner_dim is False and given.enable_fsdp_float8_all_gather is False


def test_constructing_never_needs_the_library(monkeypatch):
    """Unlike Accelerate, no ImportError at construction: the Accelerator says what is missing."""
    assert importlib.util.find_spec("transformer_engine") is None  # not installed here
    TERecipeKwargs()
    MSAMPRecipeKwargs()
    no_warning_construct(FP8RecipeKwargs, backend="te")
    recipes = pytest.importorskip("hasten.settings.recipes")
    monkeypatch.setattr(recipes, "torchao_float8", lambda: None)  # as without torchao
    ao = AORecipeKwargs()
    assert ao.config is None and ao.pad_inner_dim is True


def test_importing_the_module_imports_neither_torch_nor_torchao():
    code = (
        "import sys, hasten.settings.recipes, hasten.settings.resolve;"
        "print('torch' in sys.modules, 'torchao' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False False", proc.stderr


# ----------------------------------------------------------------------------- environment


def test_each_variable_sets_its_default(monkeypatch):
    for name, value in {
        "USE_AUTOCAST_DURING_EVAL": "true",
        "MARGIN": "3",
        "INTERVAL": "5",
        "FORMAT": "e5m2",
        "AMAX_HISTORY_LEN": "16",
        "AMAX_COMPUTE_ALGO": "MAX",
        "OVERRIDE_FPROP": "1",
        "OVERRIDE_WGRAD": "yes",
        "USE_MXFP8_BLOCK_SCALING": "on",
        "OPT_LEVEL": "O1",
        "PAD_INNER_DIM": "false",
        "ENABLE_FSDP_FLOAT8_ALL_GATHER": "0",
        "BACKEND": "msamp",
    }.items():
        monkeypatch.setenv(f"ACCELERATE_FP8_{name}", value)
    te = TERecipeKwargs()
    assert (te.use_autocast_during_eval, te.margin, te.interval, te.fp8_format) == (True, 3, 5, "E5M2")
    assert (te.amax_history_len, te.amax_compute_algo) == (16, "max")
    assert te.override_linear_precision == (True, False, True) and te.use_mxfp8_block_scaling is True
    assert MSAMPRecipeKwargs().opt_level == "O1"
    ao = AORecipeKwargs()
    assert (ao.pad_inner_dim, ao.enable_fsdp_float8_all_gather) == (False, False)
    if ao.config is not None:
        assert ao.config.pad_inner_dim is False and ao.config.enable_fsdp_float8_all_gather is False
    fp8 = no_warning_construct(FP8RecipeKwargs)
    assert (fp8.backend, fp8.opt_level, fp8.margin) == ("MSAMP", "O1", 3)
    assert fp8_backend_from_env() == FP8BackendType.MSAMP
    # what the code passes wins over the variable
    te = TERecipeKwargs(margin=0, fp8_format="HYBRID", override_linear_precision=(False, False, False))
    assert (te.margin, te.fp8_format, te.override_linear_precision) == (0, "HYBRID", (False, False, False))


@pytest.mark.parametrize(
    "variable, value, cls, words",
    [
        ("ACCELERATE_FP8_MARGIN", "-1", TERecipeKwargs, ["TERecipeKwargs.margin (from ACCELERATE_FP8_MARGIN)", ">= 0"]),
        ("ACCELERATE_FP8_MARGIN", "x", TERecipeKwargs, ["environment variable ACCELERATE_FP8_MARGIN", "integer"]),
        ("ACCELERATE_FP8_FORMAT", "E3M4", TERecipeKwargs, ["fp8_format (from ACCELERATE_FP8_FORMAT)", "'HYBRID'"]),
        ("ACCELERATE_FP8_OVERRIDE_DGRAD", "maybe", TERecipeKwargs, ["ACCELERATE_FP8_OVERRIDE_DGRAD", "true/false"]),
        ("ACCELERATE_FP8_OPT_LEVEL", "O3", MSAMPRecipeKwargs, ["opt_level (from ACCELERATE_FP8_OPT_LEVEL)", "'O1'"]),
        ("ACCELERATE_FP8_PAD_INNER_DIM", "2", AORecipeKwargs, ["ACCELERATE_FP8_PAD_INNER_DIM", "true/false"]),
        ("ACCELERATE_FP8_BACKEND", "AO", FP8RecipeKwargs, ["backend (from ACCELERATE_FP8_BACKEND)", "'TE', 'MSAMP'"]),
    ],
)
def test_a_bad_variable_is_named(monkeypatch, variable, value, cls, words):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as err:
        no_warning_construct(cls)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_every_variable_is_declared_in_the_environment_module():
    names = {
        "BACKEND", "PAD_INNER_DIM", "ENABLE_FSDP_FLOAT8_ALL_GATHER", "USE_AUTOCAST_DURING_EVAL", "MARGIN",
        "INTERVAL", "FORMAT", "AMAX_HISTORY_LEN", "AMAX_COMPUTE_ALGO", "OVERRIDE_FPROP", "OVERRIDE_DGRAD",
        "OVERRIDE_WGRAD", "USE_MXFP8_BLOCK_SCALING", "OPT_LEVEL",
    }  # fmt: skip
    assert sorted(FP8_VARIABLES) == sorted(f"ACCELERATE_FP8_{n}" for n in names)
    assert all(getattr(environment, n) == n for n in FP8_VARIABLES)


# ----------------------------------------------------------------------------- checks

TE_BAD = [
    ({"use_autocast_during_eval": "yes"}, TypeError, "TERecipeKwargs.use_autocast_during_eval must be True or False"),
    ({"margin": -1}, ValueError, "TERecipeKwargs.margin must be >= 0, got -1"),
    ({"margin": 1.5}, TypeError, "TERecipeKwargs.margin must be an integer, got 1.5"),
    ({"interval": 0}, ValueError, "TERecipeKwargs.interval must be >= 1, got 0"),
    (
        {"fp8_format": "E3M4"},
        ValueError,
        "TERecipeKwargs.fp8_format must be one of 'HYBRID', 'E4M3', 'E5M2', got 'E3M4'",
    ),
    ({"fp8_format": 8}, TypeError, "TERecipeKwargs.fp8_format must be one of 'HYBRID', 'E4M3', 'E5M2', got 8"),
    ({"amax_history_len": 0}, ValueError, "TERecipeKwargs.amax_history_len must be >= 1, got 0"),
    ({"amax_compute_algo": "mean"}, ValueError, "amax_compute_algo must be one of 'max', 'most_recent', got 'mean'"),
    ({"override_linear_precision": True}, TypeError, "override_linear_precision must be a tuple of three booleans"),
    ({"override_linear_precision": (True, False)}, ValueError, "got (True, False) (2 items)"),
    ({"override_linear_precision": (True, 0, False)}, TypeError, "override_linear_precision[1] must be True or False"),
    ({"use_mxfp8_block_scaling": 1}, TypeError, "TERecipeKwargs.use_mxfp8_block_scaling must be True or False"),
]


@pytest.mark.parametrize("kwargs, exc, message", TE_BAD, ids=[str(k) for k, _, _ in TE_BAD])
def test_te_checks(kwargs, exc, message):
    with pytest.raises(exc) as err:
        TERecipeKwargs(**kwargs)
    assert message in str(err.value)
    with pytest.raises(exc) as err:  # FP8RecipeKwargs checks the same fields, under its own name
        no_warning_construct(FP8RecipeKwargs, backend="TE", **kwargs)
    assert message.replace("TERecipeKwargs", "FP8RecipeKwargs") in str(err.value)


def test_case_is_folded_as_accelerate_does():
    te = TERecipeKwargs(fp8_format="e4m3", amax_compute_algo="MOST_RECENT", override_linear_precision=[1 == 1] * 3)
    assert (te.fp8_format, te.amax_compute_algo, te.override_linear_precision) == ("E4M3", "most_recent", (True,) * 3)
    assert MSAMPRecipeKwargs(opt_level="o1").opt_level == "O1"
    assert no_warning_construct(FP8RecipeKwargs, backend="msamp").backend == "MSAMP"


@pytest.mark.parametrize(
    "cls, kwargs, exc, message",
    [
        (MSAMPRecipeKwargs, {"opt_level": "O3"}, ValueError, "MSAMPRecipeKwargs.opt_level must be one of 'O1', 'O2'"),
        (
            MSAMPRecipeKwargs,
            {"opt_level": 2},
            TypeError,
            "MSAMPRecipeKwargs.opt_level must be one of 'O1', 'O2', got 2",
        ),
        (
            FP8RecipeKwargs,
            {"backend": "AO"},
            ValueError,
            "FP8RecipeKwargs.backend must be one of 'TE', 'MSAMP', got 'AO'",
        ),
        # Accelerate's FP8RecipeKwargs never checks MS-AMP's field; hasten's does
        (FP8RecipeKwargs, {"opt_level": "O9"}, ValueError, "FP8RecipeKwargs.opt_level must be one of 'O1', 'O2'"),
        (
            AORecipeKwargs,
            {"module_filter_func": "fc1"},
            TypeError,
            "AORecipeKwargs.module_filter_func must be a callable",
        ),
        (
            AORecipeKwargs,
            {"pad_inner_dim": "no"},
            TypeError,
            "AORecipeKwargs.pad_inner_dim must be True, False or None",
        ),
        (
            AORecipeKwargs,
            {"enable_fsdp_float8_all_gather": 1},
            TypeError,
            "AORecipeKwargs.enable_fsdp_float8_all_gather must be True, False or None, got 1",
        ),
        (
            AORecipeKwargs,
            {"config": {"pad_inner_dim": True}},
            TypeError,
            "AORecipeKwargs.config must be a torchao.float8.Float8LinearConfig or None, got {'pad_inner_dim': True}",
        ),
    ],
)
def test_other_checks(cls, kwargs, exc, message):
    with pytest.raises(exc) as err:
        no_warning_construct(cls, **kwargs)
    assert message in str(err.value)


def test_ao_field_that_disagrees_with_the_config_is_refused():
    float8 = _float8()
    with pytest.raises(
        ValueError, match=r"AORecipeKwargs.pad_inner_dim=True disagrees with config.pad_inner_dim=False"
    ):
        AORecipeKwargs(config=float8.Float8LinearConfig(pad_inner_dim=False), pad_inner_dim=True)

    class MyConfig(float8.Float8LinearConfig):  # a subclass is a Float8LinearConfig too
        pass

    assert isinstance(AORecipeKwargs(config=MyConfig()).config, MyConfig)


def test_to_kwargs_gives_what_differs_from_the_defaults():
    assert TERecipeKwargs().to_kwargs() == {}
    assert TERecipeKwargs(margin=2, fp8_format="e4m3").to_kwargs() == {"margin": 2, "fp8_format": "E4M3"}
    assert MSAMPRecipeKwargs(opt_level="O1").to_kwargs() == {"opt_level": "O1"}
    assert MSAMPRecipeKwargs().to_kwargs() == {}
    assert AORecipeKwargs().to_kwargs() == {}
    if importlib.util.find_spec("torchao") is not None:
        kwargs = AORecipeKwargs(pad_inner_dim=False).to_kwargs()
        assert set(kwargs) == {"pad_inner_dim", "config"} and kwargs["pad_inner_dim"] is False
    fp8 = no_warning_construct(FP8RecipeKwargs, backend="TE", interval=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning from the default instance compared with
        kwargs = fp8.to_kwargs()
    assert kwargs == ({"interval": 4, "backend": "TE"} if HAS_MSAMP else {"interval": 4})


def test_fp8_recipe_kwargs_is_deprecated_with_a_future_warning_at_the_callers_line():
    with pytest.warns(FutureWarning, match="FP8RecipeKwargs is deprecated.*TERecipeKwargs or MSAMPRecipeKwargs") as w:
        FP8RecipeKwargs(backend="TE")
    assert w[0].filename == __file__
    assert isinstance(FP8RecipeKwargs.__mro__[1](), TERecipeKwargs)


# ----------------------------------------------------------------------------- exports


def test_accelerates_module_paths():
    import hasten.utils
    import hasten.utils.dataclasses

    for name in ("AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs", "FP8BackendType"):
        for module in (hasten.utils, hasten.utils.dataclasses):
            assert getattr(module, name) is getattr(sys.modules["hasten.settings.recipes"], name)
            assert name in module.__all__
    assert [m.value for m in FP8BackendType] == ["NO", "TE", "MSAMP", "AO"]
    assert FP8BackendType("AO") is FP8BackendType.AO and FP8BackendType.TE == "TE" and str(FP8BackendType.AO) == "AO"
    assert "fp8" in MIXED_PRECISION_CHOICES


# ----------------------------------------------------------------------------- resolution


def settings(**given):
    """What the Accelerator resolves its arguments with (no process group, no Accelerator)."""
    args = {
        "split_batches": SPLIT_BATCHES_DEFAULT,
        "even_batches": EVEN_BATCHES_DEFAULT,
        "mixed_precision": None,
        "gradient_accumulation_steps": None,
        "kwargs_handlers": None,
        "dataloader_config": None,
        "project_dir": None,
        "project_config": None,
        "gradient_accumulation_plugin": None,
        "unexpected": {},
        "flags": {},
    }
    return resolve(**{**args, **given})


def test_each_recipe_handler_is_a_kind_of_its_own():
    ao, te, ms = AORecipeKwargs(), TERecipeKwargs(), MSAMPRecipeKwargs()
    fp8 = no_warning_construct(FP8RecipeKwargs, backend="TE")
    for handler, backend in ((ao, "AO"), (te, "TE"), (ms, "MSAMP"), (fp8, "TE")):
        s = settings(mixed_precision="fp8", kwargs_handlers=[handler])
        assert s.handler(type(handler)) is handler and s.recipe_handler is handler
        assert s.fp8_backend == FP8BackendType(backend) and s.mixed_precision == "fp8"
    s = settings(mixed_precision="fp8", kwargs_handlers=[fp8])
    assert s.handler(TERecipeKwargs) is None and s.handler(MSAMPRecipeKwargs) is None
    plain = settings(mixed_precision="fp8")
    assert plain.recipe_handler is None and plain.fp8_backend == FP8BackendType.NO


def test_one_recipe_handler_at_most():
    te = TERecipeKwargs()
    fp8 = no_warning_construct(FP8RecipeKwargs, backend="TE")
    with pytest.raises(ValueError, match=r"two fp8 recipe handlers \(AORecipeKwargs and TERecipeKwargs\); pass one"):
        settings(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(), te])
    with pytest.raises(ValueError, match=r"two fp8 recipe handlers \(FP8RecipeKwargs and TERecipeKwargs\)"):
        settings(mixed_precision="fp8", kwargs_handlers=[fp8, te])
    with pytest.raises(ValueError, match="two TERecipeKwargs objects"):
        settings(mixed_precision="fp8", kwargs_handlers=[te, TERecipeKwargs()])


def test_a_recipe_handler_needs_mixed_precision_fp8(monkeypatch):
    for given in (None, "no", "bf16"):
        with pytest.raises(ValueError) as err:
            settings(mixed_precision=given, kwargs_handlers=[TERecipeKwargs()])
        message = str(err.value)
        assert "TERecipeKwargs, an fp8 recipe handler" in message and "needs mixed_precision='fp8'" in message
        assert f"mixed_precision is {given or 'no'!r}" in message
    # resolved first: the launcher's mixed precision counts
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "fp8")
    assert settings(kwargs_handlers=[MSAMPRecipeKwargs()]).fp8_backend == FP8BackendType.MSAMP


def test_with_fsdp_a_recipe_handler_may_come_without_fp8():
    from hasten.settings.plugins import FullyShardedDataParallelPlugin

    s = settings(kwargs_handlers=[AORecipeKwargs()], fsdp_plugin=FullyShardedDataParallelPlugin())
    assert s.mixed_precision == "no" and s.fp8_backend == FP8BackendType.AO


def test_the_launchers_backend(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "ao")
    assert settings(mixed_precision="fp8").fp8_backend == FP8BackendType.AO
    with pytest.warns(UserWarning, match=r"TERecipeKwargs in code overrides ACCELERATE_FP8_BACKEND='AO'.*using 'TE'"):
        assert settings(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()]).fp8_backend == "TE"
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "fp4")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_BACKEND must be one of 'NO', 'TE', 'MSAMP', 'AO'.*'fp4'"):
        settings(mixed_precision="fp8")


def test_the_accelerator_refuses_a_recipe_without_fp8():
    from hasten import Accelerator

    with pytest.raises(ValueError, match="AORecipeKwargs, an fp8 recipe handler, but mixed_precision is 'no'"):
        Accelerator(cpu=True, kwargs_handlers=[AORecipeKwargs()])


def test_the_accelerator_takes_a_recipe_with_fp8():
    if importlib.util.find_spec("hasten.training.float8") is None:
        pytest.skip("needs the fp8 runtime")
    _float8()
    from hasten import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
    assert accelerator.state.mixed_precision == "fp8"


# ----------------------------------------------------------------------------- config file and launcher

FP8_FILE = """\
mixed_precision: fp8
fp8_config:
  backend: te
  fp8_format: e4m3
  margin: 2
  amax_history_length: 16        # Accelerate's config writes these three names
  amax_compute_algorithm: max
  optimization_level: O1
  override_linear_precision: [false, false, true]
  use_autocast_during_eval: true
  pad_inner_dim: false
"""


def test_fp8_config_section_becomes_the_fp8_settings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(FP8_FILE)
    cfg = config.load_config(path)
    assert cfg.launch == {
        "mixed_precision": "fp8",
        "fp8_backend": "TE",
        "fp8_format": "E4M3",
        "fp8_margin": 2,
        "fp8_amax_history_len": 16,
        "fp8_amax_compute_algo": "max",
        "fp8_opt_level": "O1",
        "fp8_override_linear_precision": "false,false,true",
        "fp8_use_autocast_during_eval": True,
        "fp8_pad_inner_dim": "false",
    }
    resolved = config.resolve_settings({}, cfg, environ={"ACCELERATE_FP8_MARGIN": "5"})
    assert resolved["fp8_margin"] == (5, "environment ACCELERATE_FP8_MARGIN")  # the environment wins over the file
    assert resolved["fp8_format"] == ("E4M3", "config file")
    split = config.resolve_settings({}, cfg, environ={"ACCELERATE_FP8_OVERRIDE_DGRAD": "1"})
    assert split["fp8_override_linear_precision"][0] == "false,true,false"
    exported = {}
    for name, (value, source) in resolved.items():
        if source != "default":
            exported.update(setting_variables(name, value))
    assert {k: val for k, val in exported.items() if k.startswith("ACCELERATE_FP8_")} == {
        "ACCELERATE_FP8_BACKEND": "TE",
        "ACCELERATE_FP8_FORMAT": "E4M3",
        "ACCELERATE_FP8_MARGIN": "5",
        "ACCELERATE_FP8_AMAX_HISTORY_LEN": "16",
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "max",
        "ACCELERATE_FP8_OPT_LEVEL": "O1",
        "ACCELERATE_FP8_OVERRIDE_FPROP": "false",
        "ACCELERATE_FP8_OVERRIDE_DGRAD": "false",
        "ACCELERATE_FP8_OVERRIDE_WGRAD": "true",
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "1",
        "ACCELERATE_FP8_PAD_INNER_DIM": "false",
    }
    (tmp_path / "short.yaml").write_text("fp8:\n  format: hybrid\n  opt_level: o2\n")
    assert config.load_config(tmp_path / "short.yaml").launch == {"fp8_format": "HYBRID", "fp8_opt_level": "O2"}


@pytest.mark.parametrize(
    "text, exc, words",
    [
        ("fp8_config:\n  bogus: 1\n", ValueError, ["line 2", "unknown key 'bogus'", "backend", "opt_level", "margin"]),
        ("fp8_config:\n  fp8_formt: E4M3\n", ValueError, ["line 2", "did you mean 'fp8_format'"]),
        ("fp8_config:\n  backend: fp4\n", ValueError, ["line 2", "fp8_backend must be one of 'AO', 'TE', 'MSAMP'"]),
        ("fp8_config:\n  margin: -1\n", ValueError, ["line 2", "fp8_margin must be >= 0, got -1"]),
        ("fp8_config:\n  fp8_format: e3m4\n", ValueError, ["fp8_format must be one of 'HYBRID', 'E4M3', 'E5M2'"]),
        ("fp8_config:\n  override_linear_precision: [true]\n", ValueError, ["three booleans", "[True]"]),
        ("fp8_config:\n  pad_inner_dim: 3\n", TypeError, ["fp8_pad_inner_dim must be true or false, got 3"]),
        ("fp8_config: [backend]\n", TypeError, ["line 1", "section 'fp8_config' must be a mapping"]),
    ],
)
def test_bad_fp8_config_is_refused_at_its_line(tmp_path, text, exc, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(exc) as err:
        config.load_config(path)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_the_launchers_table_takes_fp8():
    from hasten.cli.launch import build_parser, parse_own

    assert parse_setting_text("mixed_precision", "FP8") == "fp8"
    parser = build_parser()
    args = parse_own(parser, ["--mixed_precision", "fp8", "--fp8_backend", "ao", "--fp8-format", "e5m2"])
    assert (args.mixed_precision, args.fp8_backend, args.fp8_format) == ("fp8", "AO", "E5M2")
    args = parse_own(parser, ["--fp8_use_autocast_during_eval", "--fp8_override_linear_precision", "true,false,false"])
    assert args.fp8_use_autocast_during_eval is True and args.fp8_override_linear_precision == "true,false,false"
    assert all(LAUNCH_SETTINGS[n].env or n == "fp8_override_linear_precision" for n in LAUNCH_SETTINGS if "fp8" in n)
    # the fp8_config keys an error lists are the --fp8_* settings (fp8_format spelled so) and Accelerate's aliases
    listed = {k.removeprefix("fp8_") for k in config.FP8_SECTION_KEYS} - {
        "amax_history_length",
        "amax_compute_algorithm",
    }
    assert listed - {"optimization_level"} == {n.removeprefix("fp8_") for n in LAUNCH_SETTINGS if n.startswith("fp8_")}


def test_launch_exports_what_the_handlers_read(tmp_path):
    """One real launch: flags and the config file reach the script's handlers."""
    script = tmp_path / "read.py"
    script.write_text(
        "import json, sys, warnings\n"
        "from dataclasses import asdict\n"
        "from hasten.settings.recipes import TERecipeKwargs, MSAMPRecipeKwargs, fp8_backend_from_env\n"
        "from hasten.settings import environment as env\n"
        "te = asdict(TERecipeKwargs())\n"
        "te['override_linear_precision'] = list(te['override_linear_precision'])\n"
        "out = {'te': te, 'opt_level': MSAMPRecipeKwargs().opt_level, 'backend': fp8_backend_from_env().value,\n"
        "       'mp': env.get('HASTEN_MIXED_PRECISION')}\n"
        "open(sys.argv[1], 'w').write(json.dumps(out))\n"
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(FP8_FILE)
    out = tmp_path / "out.json"
    proc = launch(
        "--config_file", cfg, "--num_processes", "1", "--cpu", "--fp8_backend", "msamp", "--fp8_interval", "7",
        script, out, timeout=120, env=launch_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["mp"] == "fp8" and got["backend"] == "MSAMP" and got["opt_level"] == "O1"
    assert got["te"] == {
        "use_autocast_during_eval": True,
        "margin": 2,
        "interval": 7,
        "fp8_format": "E4M3",
        "amax_history_len": 16,
        "amax_compute_algo": "max",
        "override_linear_precision": [False, False, True],
        "use_mxfp8_block_scaling": False,
    }
