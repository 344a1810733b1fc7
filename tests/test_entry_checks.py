"""Checks at the point of entry (issue 38): bounded config files, paths refused at construction,
and a closed stdout that ends every ``hasten`` command quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hasten import GeneralTracker, ProfileKwargs, ProjectConfiguration, tracking
from hasten import _validate as v
from hasten.settings import config_file as hconfig
from hasten.settings.resolve import project_configuration
from launch_utils import launch_env

pytest.importorskip("yaml", reason="config files need PyYAML")

HASTEN = [sys.executable, "-m", "hasten.cli"]
TOO_BIG = "is too large or too deeply nested"


def _bomb(key: str = "num_processes", levels: int = 9) -> str:
    """Billion laughs in one line: ``levels`` anchors of 9 aliases each, 9**levels values."""
    parts = ['&a0 ["x","x","x","x","x","x","x","x","x"]']
    parts += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return f"{key}: [{', '.join(parts)}]\n"


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _hasten(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*HASTEN, *args], env=kwargs.pop("env", None) or launch_env(), capture_output=True, text=True,
        timeout=timeout, **kwargs,
    )  # fmt: skip


# ----------------------------------------------------------------------------- bounded config files


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (_bomb(), "num_processes"),  # the file: 340 bytes, 387 million values
        # the anchors under keys of their own: refused at the key where the count passes the bound
        (
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
            "d",
        ),
        ("profile: {activities: " + _bomb("x").split(": ", 1)[1].strip() + "}\n", "profile"),
        # merge keys copy the mappings they name: 2**30 copies
        ("x0: &x0 {k: 1}\n" + "".join(f"x{i}: &x{i} {{<<: [*x{i - 1}, *x{i - 1}]}}\n" for i in range(1, 31)), "x9"),
        ("num_processes: " + "[" * 5000 + "]" * 5000 + "\n", "num_processes"),  # the composer would recurse
    ],
    ids=["one-line", "keys", "section", "merge", "deep"],
)
def test_a_config_too_large_or_deep_is_refused_at_once_naming_the_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        hconfig.load_config(path)
    assert time.monotonic() - start < 1.0
    message = str(err.value)
    assert message.startswith(f"config file {path}, line ") and f": {key} {TOO_BIG}" in message, message
    assert f"more than {hconfig.MAX_CONFIG_VALUES} values or {hconfig.MAX_CONFIG_DEPTH} levels" in message
    assert len(message) < 400


def test_a_self_referring_alias_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: num_processes refers to itself \(\*n inside &n\)"):
        hconfig.load_config(_write(tmp_path, "num_processes: &n [1, *n]\n"))


def test_a_small_file_with_aliases_still_loads(tmp_path):
    path = _write(tmp_path, "num_processes: &n 2\nmax_restarts: *n\nprofile: {activities: &acts [cpu]}\n")
    cfg = hconfig.load_config(path)
    assert cfg.launch["num_processes"] == 2 and cfg.launch["max_restarts"] == 2
    assert hconfig.build_handlers(cfg)[0].activities == ["cpu"]


def test_every_reader_of_config_files_refuses_the_bomb(tmp_path, monkeypatch):
    bomb = _write(tmp_path, _bomb(), "bomb.yaml")
    script = _write(tmp_path, "print('ran')\n", "script.py")
    # what an Accelerator built under `hasten launch` reads (settings.py -> handlers_from_env)
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(bomb))
    with pytest.raises(ValueError, match=f"num_processes {TOO_BIG}"):
        hconfig.handlers_from_env()
    # the command line: launch, config show, and config --force (which keeps the old file's sections)
    runs = [
        ("launch", "--config_file", str(bomb), str(script)),
        ("config", "show", "--config_file", str(bomb)),
        ("config", "--default", "--force", "--config_file", str(bomb)),
    ]
    for args in runs:
        proc = _hasten(*args, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert f"config file {bomb}, line 1: num_processes {TOO_BIG}" in proc.stderr, (args, proc.stderr[-2000:])
        assert "ran" not in proc.stdout and "Traceback" not in proc.stderr
    assert bomb.read_text() == _bomb()  # config --force refused: the file is as it was


def test_error_messages_quote_values_bounded(tmp_path):
    nested: list = ["x"] * 9
    for _ in range(8):
        nested = [nested] * 9
    assert len(v.shown(nested)) <= v.MAX_SHOWN and len(v.shown("y" * 10**6)) <= v.MAX_SHOWN
    assert v.shown(10**5000) == "<an integer of 16610 bits>"  # repr() itself refuses it
    assert v.shown({"b": 1, "a": [1, 2]}) == "{'b': 1, 'a': [1, 2]}"  # as repr() for small values
    with pytest.raises(TypeError) as err:
        v.check_number("", "num_processes", ["z" * 10**6], integer=True)
    assert len(str(err.value)) < 600
    path = _write(tmp_path, f"main_process_ip: [{'w' * 500_000}]\nnum_machines: 1\n")
    with pytest.raises(TypeError) as err:
        hconfig.load_config(path)
    assert "main_process_ip must be a host name" in str(err.value) and len(str(err.value)) < 800


# ----------------------------------------------------------------------------- paths, at construction


class _Writer(GeneralTracker):
    """A tracker that writes under the logging directory (as TensorBoard does); never started here."""

    name = "entry_writer"
    requires_logging_directory = True

    def __init__(self, run_name, logging_dir):
        super().__init__()

    @property
    def tracker(self):
        return None


@pytest.fixture
def writer_tracker(monkeypatch):
    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, _Writer.name, _Writer)
    return _Writer.name


def test_a_logging_dir_that_is_a_file_is_refused_at_accelerator(tmp_path, writer_tracker):
    from hasten import Accelerator

    afile = _write(tmp_path, "x", "afile")
    with pytest.raises(ValueError) as err:
        Accelerator(log_with=writer_tracker, project_dir=afile, cpu=True)
    message = str(err.value)
    assert f"Accelerator(log_with='{writer_tracker}') writes its logs under the logging directory '{afile}'" in message
    assert "which is a file, not a folder: pass a folder" in message
    under_a_file = ProjectConfiguration(logging_dir=str(afile / "logs"))
    with pytest.raises(ValueError, match=f"cannot be created: '{afile}' is a file"):
        Accelerator(log_with=writer_tracker, project_config=under_a_file, cpu=True)
    assert afile.read_text() == "x"
    # only the main process checks (it alone builds the trackers); a tracker that writes nothing is not checked
    tracking.Trackers(writer_tracker, str(afile), is_main_process=False)
    tracking.Trackers(None, str(afile), is_main_process=True)


def test_a_read_only_logging_dir_is_refused(tmp_path, writer_tracker, monkeypatch):
    # The tests run as root, for whom chmod does not stop writes: a read-only folder (or file
    # system, EROFS) is simulated by os.access answering no, as it does there for other users.
    target = tmp_path / "run"
    tracking.Trackers(writer_tracker, str(target), is_main_process=True)  # writable: accepted, not created
    assert not target.exists()
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(ValueError, match=f"which cannot be created: '{tmp_path}' is not writable by this user"):
        tracking.Trackers(writer_tracker, str(target), is_main_process=True)
    target.mkdir()
    with pytest.raises(ValueError, match="which is not writable by this user"):
        tracking.Trackers(writer_tracker, str(target), is_main_process=True)
    monkeypatch.setattr(v, "_read_only_fs", lambda path: True)
    with pytest.raises(ValueError, match="which is on a read-only file system"):
        tracking.Trackers(writer_tracker, str(target), is_main_process=True)


def test_profile_output_trace_dir_must_be_a_folder(tmp_path):
    afile = _write(tmp_path, "x", "afile")
    with pytest.raises(ValueError, match=r"ProfileKwargs.output_trace_dir '.*afile' is a file, not a folder: it must"):
        ProfileKwargs(output_trace_dir=afile)
    with pytest.raises(ValueError, match=r"output_trace_dir '.*afile/traces' cannot be created: '.*afile' is a file"):
        ProfileKwargs(output_trace_dir=afile / "traces")
    assert ProfileKwargs(output_trace_dir=tmp_path / "new" / "traces").output_trace_dir.endswith("traces")
    assert not (tmp_path / "new").exists()  # checked, not created
    with pytest.raises(ValueError, match=r"output_trace_dir 'a\\x00b' holds a NUL character, which no path can"):
        ProfileKwargs(output_trace_dir="a\x00b")  # os.stat's own "embedded null byte" before


@pytest.mark.parametrize("field", ["project_dir", "logging_dir"])
def test_an_empty_project_path_is_refused(field):
    with pytest.raises(ValueError, match=f"ProjectConfiguration.{field} must be a non-empty path or None, got ''"):
        ProjectConfiguration(**{field: ""})


def test_accelerator_project_dir_empty_is_refused():
    with pytest.raises(ValueError, match="Accelerator.project_dir must be a non-empty path or None, got ''"):
        project_configuration("", None)
    given = ProjectConfiguration()
    with pytest.raises(ValueError, match="Accelerator.project_dir must be a non-empty path"):
        project_configuration("", given)
    assert given.project_dir is None and given.logging_dir is None  # refused: unchanged


# ----------------------------------------------------------------------------- closed stdout

PRINTERS = [
    ["config", "show"], ["env"], ["--help"], ["launch", "--help"], ["config", "--help"],
    ["demo", "--help"], ["merge-weights", "--help"], ["profile-report", "--help"], ["estimate-memory", "--help"],
]  # fmt: skip


def _into_closed_pipe(args: list[str], buffered: bool) -> subprocess.CompletedProcess:
    """Run ``hasten *args`` with stdout a pipe whose reader closed before it started."""
    env = launch_env()
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [*HASTEN, *args], stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)


@pytest.mark.parametrize("args", PRINTERS, ids=" ".join)
def test_a_closed_stdout_ends_each_command_quietly(args):
    for buffered in (True, False):  # printed at once, or left in the buffer for the last flush
        proc = _into_closed_pipe(args, buffered)
        assert proc.returncode == 141, (args, buffered, proc.returncode, proc.stderr[-2000:])
        assert proc.stderr == "", (args, buffered, proc.stderr[-2000:])


def test_a_failure_into_a_closed_stdout_keeps_its_status(tmp_path):
    # `hasten config` asks; with no answers (stdin empty) it fails: that error, not the closed pipe
    # its question went to, and not "Exception ignored ... BrokenPipeError" (status 120) at exit
    args = ["config", "--config_file", str(tmp_path / "c.yaml")]
    proc = _into_closed_pipe(args, buffered=True)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "hasten config: error: no answer to 'How many machines?'" in proc.stderr
    assert "Broken" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("args", [["config", "show"], ["env"], ["--help"], ["launch", "--help"]], ids=" ".join)
def test_reading_one_line_and_closing_the_pipe(args):
    proc = subprocess.Popen([*HASTEN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=launch_env())
    first = proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert first.strip()
    # 0 when it had written everything before the pipe closed, 141 when a write found it closed
    assert proc.returncode in (0, 141), (proc.returncode, err[-2000:])
    assert err == b"", err.decode()[-2000:]


def test_env_names_a_config_path_it_cannot_read(tmp_path, monkeypatch):
    from hasten.cli.env import env_lines

    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path))
    expected = f"config file '{tmp_path}' (from HASTEN_CONFIG_FILE) is a folder, not a file"
    assert env_lines()[-1].startswith(f"config file: {expected}")  # a line of the report, not a traceback
