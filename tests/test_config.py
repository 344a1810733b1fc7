"""hasten.settings.config_file: reading, checking and writing config files; handlers from the file."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

from hasten.settings import config_file as config
from hasten.settings.handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)


@pytest.fixture(autouse=True)
def _config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no Accelerate default config file either


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """\
num_processes: 2
mixed_precision: no          # YAML reads a bare no as false: still means "no"
ddp:
  bucket_cap_mb: 50
  comm_hook: power_sgd
  comm_state_option: {matrix_approximation_rank: 2}
autocast: {cache_enabled: false}
grad_scaler: {init_scale: 1024, growth_interval: 10}
profile: {activities: [cpu], schedule_option: {wait: 1, active: 2}}
process_group: {timeout: 900, backend: gloo}
"""


def test_every_section_becomes_its_handler(tmp_path):
    handlers = {type(h): h for h in config.handlers_from_file(write(tmp_path, GOOD))}
    assert handlers[DistributedDataParallelKwargs].bucket_cap_mb == 50
    assert handlers[DistributedDataParallelKwargs].comm_hook == "power_sgd"
    assert handlers[DistributedDataParallelKwargs].comm_state_option == {"matrix_approximation_rank": 2}
    assert handlers[AutocastKwargs].cache_enabled is False
    assert handlers[GradScalerKwargs].init_scale == 1024 and handlers[GradScalerKwargs].growth_interval == 10
    assert handlers[ProfileKwargs].activities == ["cpu"]
    assert handlers[ProfileKwargs].schedule_option == {"wait": 1, "active": 2}
    pg = handlers[InitProcessGroupKwargs]
    assert pg.timeout == timedelta(seconds=900) and not pg.timeout_is_auto and pg.backend == "gloo"
    cfg = config.load_config(tmp_path / "c.yaml")
    assert cfg.launch == {"num_processes": 2, "mixed_precision": "no"}


def test_handlers_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv("HASTEN_CONFIG_FILE", raising=False)
    assert config.handlers_from_env() == []
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(write(tmp_path, "ddp: {bucket_cap_mb: 7}\n")))
    assert config.handlers_from_env() == [DistributedDataParallelKwargs(bucket_cap_mb=7)]


def test_bad_handler_value_reuses_the_handler_message_with_file_and_line(tmp_path):
    path = write(tmp_path, "num_processes: 2\nddp:\n  dim: 0\n  bucket_cap_mb: -1\n")
    with pytest.raises(ValueError) as caught:
        config.handlers_from_file(path)
    with pytest.raises(ValueError) as direct:
        DistributedDataParallelKwargs(bucket_cap_mb=-1)
    message = str(caught.value)
    assert message.startswith(f"{path}, line 4:")
    assert str(direct.value) in message  # the handler's own rule and words, not a copy


def test_handler_type_errors_stay_type_errors(tmp_path):
    path = write(tmp_path, "grad_scaler:\n  enabled: maybe\n")
    with pytest.raises(TypeError, match=r"line 2: .*GradScalerKwargs\.enabled must be True or False"):
        config.handlers_from_file(path)


def test_nested_key_error_points_at_its_own_line(tmp_path):
    path = write(tmp_path, "ddp:\n  comm_hook: power_sgd\n  comm_state_option:\n    rank: 2\n")
    with pytest.raises(ValueError, match=r"line 4: .*unknown key 'rank'.*matrix_approximation_rank"):
        config.handlers_from_file(path)


def test_cross_field_handler_error_names_the_field_line(tmp_path):
    path = write(tmp_path, "ddp:\n  comm_hook: fp16\n  comm_state_option: {matrix_approximation_rank: 2}\n")
    with pytest.raises(ValueError, match=r"line 3: .*comm_state_option is only used by the PowerSGD hooks"):
        config.handlers_from_file(path)


def test_unknown_section_key_lists_the_handler_fields(tmp_path):
    path = write(tmp_path, "num_processes: 2\nddp:\n  bucket_cap: 10\n")
    with pytest.raises(ValueError) as caught:
        config.load_config(path)
    message = str(caught.value)
    assert f"{path}, line 3" in message and "unknown key 'bucket_cap'" in message
    assert "did you mean 'bucket_cap_mb'" in message
    assert "ddp (DistributedDataParallelKwargs): dim, broadcast_buffers, bucket_cap_mb" in message


def test_unknown_top_level_key_lists_settings_and_sections(tmp_path):
    path = write(tmp_path, "num_processes: 2\n\nnum_proceses: 3\n")
    with pytest.raises(ValueError) as caught:
        config.load_config(path)
    message = str(caught.value)
    assert "line 3" in message and "did you mean 'num_processes'" in message
    assert "gradient_accumulation_steps" in message and "process_group (InitProcessGroupKwargs)" in message


@pytest.mark.parametrize(
    "text, error, words",
    [
        ("num_processes: 0\n", ValueError, ["line 1", "num_processes must be >= 1"]),
        ("cpu: true\nnum_processes: '2'\n", TypeError, ["line 2", "num_processes must be an integer"]),
        ("mixed_precision: fp4\n", ValueError, ["line 1", "'no', 'fp16', 'bf16', 'fp8'"]),
        ("rdzv_backend: etcd\n", ValueError, ["line 1", "'static', 'c10d'"]),
        ("main_process_port: 99999\n", ValueError, ["line 1", "<= 65535"]),
        ("process_group:\n  timeout: soon\n", TypeError, ["line 2", "timeout must be a number", "(seconds)"]),
        (
            "process_group:\n  timeout: -5\n",
            ValueError,
            ["line 2", "timeout must be >= 0.001 and <= 3153600000.0", "got -5"],
        ),
        # 1e300 seconds overflowed timedelta() (OverflowError); under 1 ms was accepted.
        ("process_group:\n  timeout: 1.0e+300\n", ValueError, ["line 2", "<= 3153600000.0", "got 1e+300", "(seconds)"]),
        ("process_group:\n  timeout: 100000000000000000000000\n", ValueError, ["line 2", "<= 3153600000.0"]),
        ("process_group:\n  timeout: 0.0001\n", ValueError, ["line 2", ">= 0.001", "got 0.0001"]),
        ("ddp: 50\n", TypeError, ["line 1", "section 'ddp' must be a mapping"]),
        ("num_processes: 2\nnum_processes: 3\n", ValueError, ["line 2", "appears twice (lines 1 and 2)"]),
        ("- 1\n- 2\n", ValueError, ["line 1", "must be a mapping"]),
        ("ddp: [\n", ValueError, ["not valid YAML"]),
    ],
)
def test_bad_files(tmp_path, text, error, words):
    path = write(tmp_path, text)
    with pytest.raises(error) as caught:
        config.handlers_from_file(path)
    assert str(path) in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_empty_file_and_null_values_mean_nothing_set(tmp_path):
    assert config.handlers_from_file(write(tmp_path, "")) == []
    cfg = config.load_config(write(tmp_path, "num_processes: null\nddp:\n", "n.yaml"))
    assert cfg.launch == {} and config.build_handlers(cfg) == [DistributedDataParallelKwargs()]


def test_write_then_read_round_trip(tmp_path):
    settings = {
        "num_processes": 4,
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "mixed_precision": "bf16",
    }
    path = config.write_config(tmp_path / "sub" / "c.yaml", settings, {"ddp": {"bucket_cap_mb": 5}})
    cfg = config.load_config(path)
    assert cfg.launch == settings and cfg.sections == {"ddp": {"bucket_cap_mb": 5}}
    assert cfg.text.startswith("# hasten config file")
    with pytest.raises(ValueError, match="num_processes must be a multiple of num_machines=2"):
        config.write_config(tmp_path / "bad.yaml", {"num_processes": 3, "num_machines": 2, "main_process_ip": "x"})
    assert not (tmp_path / "bad.yaml").exists()


def test_default_path_and_which_file_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("HASTEN_CONFIG_FILE", raising=False)
    assert config.default_config_path() == tmp_path / "home" / "default_config.yaml"
    assert config.find_config_file() is None  # the default file does not exist yet
    default = config.write_config(config.default_config_path(), {"num_processes": 1})
    assert config.find_config_file() == default.resolve()
    other = write(tmp_path, "num_processes: 2\n", "other.yaml")
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(other))
    assert config.find_config_file() == other.resolve()
    assert config.find_config_file(default) == default.resolve()  # explicit beats the variable
    with pytest.raises(FileNotFoundError, match="missing.yaml.*--config_file"):
        config.find_config_file(tmp_path / "missing.yaml")
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "gone.yaml"))
    with pytest.raises(FileNotFoundError, match="gone.yaml.*HASTEN_CONFIG_FILE"):
        config.find_config_file()
    monkeypatch.delenv("HASTEN_CONFIG_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.default_config_path() == tmp_path / "xdg" / "hasten" / "default_config.yaml"


def test_precedence_flag_env_file_default(tmp_path):
    cfg = config.load_config(
        write(tmp_path, "mixed_precision: fp16\ngradient_accumulation_steps: 3\nnum_processes: 2\n")
    )
    env = {"HASTEN_GRADIENT_ACCUMULATION_STEPS": "5", "HASTEN_USE_CPU": "1"}
    got = config.resolve_settings({"mixed_precision": "bf16"}, cfg, env)
    assert got["mixed_precision"] == ("bf16", "flag")
    assert got["gradient_accumulation_steps"] == (5, "environment HASTEN_GRADIENT_ACCUMULATION_STEPS")
    assert got["cpu"] == (True, "environment HASTEN_USE_CPU")
    assert got["num_processes"] == (2, "config file")
    assert got["num_machines"] == (1, "default")
    with pytest.raises(
        ValueError, match="HASTEN_GRADIENT_ACCUMULATION_STEPS: gradient_accumulation_steps must be >= 1"
    ):
        config.resolve_settings({}, None, {"HASTEN_GRADIENT_ACCUMULATION_STEPS": "0"})


def test_settings_that_must_fit_together_are_checked_after_flags(tmp_path):
    path = write(tmp_path, "num_machines: 2\nmachine_rank: 3\n")
    cfg = config.load_config(path)  # the flags may still fix it
    fixed = config.resolve_settings({"machine_rank": 1, "main_process_ip": "10.0.0.1"}, cfg, {})
    assert fixed["machine_rank"] == (1, "flag") and fixed["num_machines"] == (2, "config file")
    with pytest.raises(ValueError) as caught:
        config.resolve_settings({"main_process_ip": "10.0.0.1"}, cfg, {})
    assert "machine_rank must be in 0 .. num_machines-1 = 1, got 3" in str(caught.value)
    assert f"machine_rank from the config file {path}, line 2" in str(caught.value)
    with pytest.raises(ValueError, match=r"num_processes must be a multiple of num_machines=2.*from the flag"):
        config.resolve_settings({"num_processes": 3, "machine_rank": 0, "main_process_ip": "x"}, cfg, {})


def test_accelerator_uses_file_handlers_and_code_wins(tmp_path, monkeypatch):
    from hasten import Accelerator

    monkeypatch.setenv(
        "HASTEN_CONFIG_FILE", str(write(tmp_path, "ddp: {bucket_cap_mb: 50}\nautocast: {enabled: false}\n"))
    )
    from_file = Accelerator()
    assert from_file.ddp_handler.bucket_cap_mb == 50 and from_file.autocast_handler.enabled is False
    in_code = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=8)])
    assert in_code.ddp_handler.bucket_cap_mb == 8 and in_code.autocast_handler.enabled is False


def test_reading_a_file_does_not_import_torch(tmp_path):
    path = write(
        tmp_path, "num_processes: 2\nddp: {bucket_cap_mb: 50, comm_hook: fp16}\nprocess_group: {timeout: 60}\n"
    )
    code = (
        "import sys; from hasten.settings import config_file as config; "
        f"hs = config.handlers_from_file({str(path)!r}); "
        "assert len(hs) == 2, hs; print('TORCH', 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "TORCH False", proc.stderr


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_boolean_environment_spellings(raw, expected, monkeypatch):
    from hasten.settings.environment import env_flag

    monkeypatch.setenv("HASTEN_USE_CPU", raw)
    assert env_flag("HASTEN_USE_CPU") is expected
    assert config.resolve_settings({}, None, {"HASTEN_USE_CPU": raw})["cpu"] == (expected, "environment HASTEN_USE_CPU")


@pytest.mark.parametrize("raw", ["garbage", "2", "y", "truee", "nope"])
def test_boolean_environment_refuses_other_text(raw, monkeypatch):
    """HASTEN_USE_CPU=garbage was read as False: now every reader names the variable and the spellings."""
    from hasten.settings.environment import env_flag

    words = r"environment variable HASTEN_USE_CPU must be one of 1/0, true/false, yes/no, on/off .*got " + repr(raw)
    monkeypatch.setenv("HASTEN_USE_CPU", raw)
    with pytest.raises(ValueError, match=words):
        env_flag("HASTEN_USE_CPU")
    with pytest.raises(ValueError, match=words):
        config.resolve_settings({}, None, {"HASTEN_USE_CPU": raw})


def test_unset_or_empty_boolean_environment_is_the_default(monkeypatch):
    from hasten.settings.environment import env_flag

    monkeypatch.delenv("HASTEN_USE_CPU", raising=False)
    assert env_flag("HASTEN_USE_CPU") is False and env_flag("HASTEN_USE_CPU", True) is True
    monkeypatch.setenv("HASTEN_USE_CPU", "")
    assert env_flag("HASTEN_USE_CPU") is False


def test_config_file_that_is_a_folder_or_a_device(tmp_path, monkeypatch):
    """HASTEN_CONFIG_FILE naming a folder was an IsADirectoryError traceback."""
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path))
    with pytest.raises(ValueError, match=r"config file .* \(from HASTEN_CONFIG_FILE\) is a folder, not a file"):
        config.handlers_from_env()
    with pytest.raises(ValueError, match=r"\(from HASTEN_CONFIG_FILE\) is a folder"):
        config.find_config_file()
    monkeypatch.setenv("HASTEN_CONFIG_FILE", "/dev/zero")
    with pytest.raises(ValueError, match=r"'/dev/zero' \(from HASTEN_CONFIG_FILE\) is not a regular file"):
        config.handlers_from_env()
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="is not a regular file"):
        config.load_config(link)


def test_config_file_size_is_bounded(tmp_path):
    """A 120 MB file kept YAML busy for minutes; above 1 MiB the file is refused before it is parsed."""
    path = tmp_path / "big.yaml"
    with open(path, "w") as f:
        f.write("num_processes: 2\n")
        f.truncate(config.MAX_CONFIG_BYTES + 1)  # sparse: no disk used
    with pytest.raises(
        ValueError, match=rf"is {config.MAX_CONFIG_BYTES + 1} bytes; a config file may be at most 1048576 bytes"
    ):
        config.load_config(path)
    with pytest.raises(ValueError, match="at most 1048576 bytes"):
        config.find_config_file(path)
    ok = write(tmp_path, "num_processes: 2\n" + "#" * 1000 + "\n", "ok.yaml")
    assert config.load_config(ok).launch == {"num_processes": 2}
    (tmp_path / "bin.yaml").write_bytes(b"num_processes: 2\n\xff\xfe")
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 17\)"):
        config.load_config(tmp_path / "bin.yaml")
