"""A plain run is quiet (issue 61; docs/launching.md's "Quiet console"): transformers imports torchao,
whose first import logs a "Failed to load ... .so" line per CUDA kernel library it cannot load and torch
logs a deprecation per enum torchao registers, on every rank. hasten/_quiet.py keeps exactly those off
the console; the same lines in any other case, and every other line of those loggers, still show."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys

import pytest
import torch

import hasten  # noqa: F401  (installs the filters)
from launch_utils import SCRIPTS, launch

OTHER_PYTHON = f"cpython-{sys.version_info[0]}{sys.version_info[1] + 1}"


def _shown(caplog, logger: str, message: str) -> bool:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=logger):
        logging.getLogger(logger).warning(message)
    return any(message in r.getMessage() for r in caplog.records)


def test_torchao_kernel_libraries_that_cannot_load_here_are_not_shown(caplog, monkeypatch):
    other_python = f"Failed to load /x/torchao/_C_mxfp8.{OTHER_PYTHON}-x86_64-linux-gnu.so: Could not load"
    this_python = f"Failed to load /x/torchao/_C_mxfp8.cpython-{sys.version_info[0]}{sys.version_info[1]}-x.so: bad"
    cuda_library = "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load this library"
    assert not _shown(caplog, "torchao", other_python)  # another Python's library: never loadable here
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not _shown(caplog, "torchao", cuda_library)  # CUDA kernels on a torch without CUDA
    assert not _shown(caplog, "torchao", this_python)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert _shown(caplog, "torchao", cuda_library)  # a real failure on a CUDA build is shown
    assert _shown(caplog, "torchao", this_python)
    assert not _shown(caplog, "torchao", other_python)
    assert _shown(caplog, "torchao", "Skipping import of cpp extensions due to incompatible torch version")


def test_the_enum_deprecation_is_hidden_only_when_torchao_registers(caplog, monkeypatch):
    line = (
        "<enum 'Mine'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
        "Calling register_constant() on Enum subclasses is deprecated"
    )
    assert _shown(caplog, "torch.utils._pytree", line)  # the user's own call: shown
    assert _shown(caplog, "torch.utils._pytree", "another torch warning")
    namespace: dict = {"logging": logging}
    code = compile("logging.getLogger('torch.utils._pytree').warning(LINE)", "/site-packages/torchao/x.py", "exec")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torch.utils._pytree"):
        exec(code, {**namespace, "LINE": line})
    assert not any("Enum subclass" in r.getMessage() for r in caplog.records)  # torchao's: hidden


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.slow  # launches / imports transformers: > 10 s
def test_a_launched_run_importing_transformers_prints_only_its_own_lines(tmp_path):
    proc = launch("--num_processes", "2", "--cpu", SCRIPTS / "quiet_transformers.py", timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr[-3000:]
    # the two ranks' lines may interleave at the write (an unbuffered print writes its text and its newline
    # apart): the script's two lines, and nothing else but line ends
    lines = re.findall(r"rank \d loss ok True", proc.stdout)
    assert sorted(lines) == ["rank 0 loss ok True", "rank 1 loss ok True"], proc.stdout
    assert re.sub(r"rank \d loss ok True", "", proc.stdout).strip() == "", proc.stdout


@pytest.mark.parametrize("processes", ["1", "2"])
def test_the_filters_are_in_place_before_the_scripts_first_line(tmp_path, processes):
    # One process execs a plain run (hasten._main), more run hasten's worker: both import hasten first.
    script = tmp_path / "first_line.py"
    script.write_text(
        "import logging, os, sys\n"
        "names = [f.__name__ for f in logging.getLogger('torchao').filters]\n"
        "line = f\"FIRST {'hasten' in sys.modules} {names} {sys.argv[1:]} {__name__}\\n\"\n"
        "os.write(1, line.encode())  # one write: the two ranks share the launcher's stdout\n"
    )
    proc = launch("--num_processes", processes, "--cpu", script, "a", "--b", timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("FIRST True ['_keep_torchao'] ['a', '--b'] __main__") == int(processes), proc.stdout
