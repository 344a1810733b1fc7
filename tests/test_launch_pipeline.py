"""``hasten launch`` and the config file carry pipeline parallelism's settings to the workers.

``--parallelism_config_pp_size``, ``--parallelism_config_pp_schedule`` and
``--parallelism_config_pp_microbatches`` (and the ``parallelism_config:`` section's ``pp_size``,
``pp_schedule``, ``pp_microbatches``) are exported as ``PARALLELISM_CONFIG_PP_*``; the script's
``ParallelismConfig()`` reads them. Everything runs in this process: ``run_workers`` is replaced by
a recorder, so a launch that passes its checks stops just before torch.distributed.run would start
the workers, with the environment they would inherit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hasten.cli import launch as cli_launch
from hasten.cli import main
from hasten.settings.config_file import load_config
from hasten.settings.parallelism import ParallelismConfig
from hasten.settings.pipeline import PIPELINE_SCHEDULES

PP_VARIABLES = ("PARALLELISM_CONFIG_PP_SIZE", "PARALLELISM_CONFIG_PP_SCHEDULE", "PARALLELISM_CONFIG_PP_MICROBATCHES")


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A clean environment (restored after the test: the launcher exports variables into it), no
    config file but the test's, and ``run_workers`` recorded instead of run."""
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for key in list(os.environ):
        if key.startswith(("HASTEN_", "ACCELERATE_", "PARALLELISM_CONFIG_", "FSDP_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HASTEN_CONFIG_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("raise SystemExit('a worker started')\n")
    calls: dict[str, Any] = {"script": str(tmp_path / "train.py")}

    def run_workers(torch_args: list[str], **_: Any) -> int:
        calls["torch_args"] = torch_args
        calls["environ"] = dict(os.environ)
        return 0

    monkeypatch.setattr(cli_launch, "run_workers", run_workers)
    return calls


def _launch(calls: dict[str, Any], *flags: str) -> int:
    return main(["launch", "--cpu", *flags, calls["script"]])


def test_the_flags_export_the_pipeline_variables_the_workers_config_reads(launcher):
    status = _launch(
        launcher,
        "--num_processes", "4",
        "--parallelism_config_pp_size", "2",
        "--parallelism-config-dp-shard-size", "2",
        "--parallelism_config_pp_schedule", "interleaved1f1b",
        "--parallelism-config-pp-microbatches", "8",
    )  # fmt: skip
    assert status == 0 and "torch_args" in launcher
    exported = launcher["environ"]
    assert {k: exported.get(k) for k in PP_VARIABLES} == {
        "PARALLELISM_CONFIG_PP_SIZE": "2",
        "PARALLELISM_CONFIG_PP_SCHEDULE": "Interleaved1F1B",  # torch's spelling, whatever the case given
        "PARALLELISM_CONFIG_PP_MICROBATCHES": "8",
    }
    assert exported["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    config = ParallelismConfig.from_env()  # what each worker's Accelerator() builds from that environment
    assert (config.pp_size, config.dp_shard_size, config.total_size) == (2, 2, 4)
    assert (config.pp_handler.schedule, config.pp_handler.microbatches) == ("Interleaved1F1B", 8)


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--parallelism_config_pp_schedule", "zigzag"],
            [
                "--parallelism_config_pp_schedule",
                "parallelism_config_pp_schedule must be one of "
                + ", ".join(map(repr, PIPELINE_SCHEDULES))
                + ", got 'zigzag'",
            ],
        ),
        (["--parallelism_config_pp_microbatches", "0"], ["parallelism_config_pp_microbatches must be >= 1, got 0"]),
        (["--parallelism_config_pp_microbatches", "two"], ["parallelism_config_pp_microbatches must be an integer"]),
        (["--parallelism_config_pp_size", "0"], ["parallelism_config_pp_size must be >= 1, got 0"]),
    ],
)
def test_a_bad_pipeline_flag_is_refused_naming_what_is_allowed(launcher, capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        _launch(launcher, "--num_processes", "2", *flags)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "torch_args" not in launcher
    for word in words:
        assert word in err, (word, err)
    assert not any(k in os.environ for k in PP_VARIABLES)  # refused: nothing exported


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num_processes", "4", "--parallelism_config_pp_size", "3"], ["pp_size=3", "multiplies to 3", "4 process"]),
        (
            ["--num_processes", "2", "--parallelism_config_pp_size", "2", "--parallelism_config_tp_size", "2"],
            ["pp_size=2", "tp_size=2", "multiplies to 4", "2 process", "pp_size x dp_replicate_size"],
        ),
    ],
)
def test_a_pp_size_that_does_not_fit_the_processes_is_refused_before_workers_start(launcher, capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        _launch(launcher, *flags)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "torch_args" not in launcher, err
    for word in words:
        assert word in err, (word, err)


def test_the_config_file_section_takes_the_pipeline_keys(launcher, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        "num_processes: 4\nparallelism_config:\n  pp_size: 2\n  dp_shard_size: 2\n"
        "  pp_schedule: gpipe\n  parallelism_config_pp_microbatches: 4\n"
    )
    cfg = load_config(path)
    assert {k: cfg.launch[k] for k in cfg.launch if k.startswith("parallelism_config_pp")} == {
        "parallelism_config_pp_size": 2,
        "parallelism_config_pp_schedule": "GPipe",
        "parallelism_config_pp_microbatches": 4,
    }
    assert cfg.launch["use_parallelism_config"] is True
    assert _launch(launcher, "--config_file", str(path)) == 0
    assert {k: launcher["environ"].get(k) for k in PP_VARIABLES} == {
        "PARALLELISM_CONFIG_PP_SIZE": "2",
        "PARALLELISM_CONFIG_PP_SCHEDULE": "GPipe",
        "PARALLELISM_CONFIG_PP_MICROBATCHES": "4",
    }
    # a flag wins over the file; the file's pp_size is still checked against the processes
    launcher.pop("torch_args")
    with pytest.raises(SystemExit):
        _launch(launcher, "--config_file", str(path), "--num_processes", "2")
    err = capsys.readouterr().err
    assert "pp_size=2" in err and "multiplies to 4, but there are 2 process(es)" in err and "torch_args" not in launcher


@pytest.mark.parametrize(
    "text, exc, words",
    [
        ("parallelism_config:\n  pp_schedule: zigzag\n", ValueError, ["line 2", "must be one of 'GPipe', '1F1B'"]),
        ("parallelism_config:\n  pp_schedule: 3\n", TypeError, ["line 2", "parallelism_config_pp_schedule", "got 3"]),
        ("parallelism_config:\n  pp_microbatches: 0\n", ValueError, ["line 2", "pp_microbatches must be >= 1"]),
        ("parallelism_config:\n  pp_sise: 2\n", ValueError, ["line 2", "did you mean 'pp_size'"]),
    ],
)
def test_a_bad_pipeline_key_in_the_config_file_is_refused_at_its_line(tmp_path, text, exc, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(exc) as info:
        load_config(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_parallelism_config_reads_the_exported_pipeline_variables(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PARALLELISM_CONFIG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SCHEDULE", "gpipe")
    config = ParallelismConfig()
    assert config.pp_size == 2 and config.pp_handler.schedule == "GPipe" and config.pp_handler.microbatches is None
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_MICROBATCHES", "6")
    assert ParallelismConfig().pp_handler.microbatches == 6
    assert ParallelismConfig(pp_size=1).pp_handler is None  # code wins over the environment
