"""Run ``hasten launch`` from tests, for real, with a timeout.

Reusable by any test that wants real processes started by hasten's own launcher::

    from launch_utils import SCRIPTS, launch, read_ranks

    def test_something(tmp_path):
        proc = launch("--num_processes", "2", SCRIPTS / "my_script.py", tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = read_ranks(tmp_path, 2)   # the script writes tmp_path/rank{RANK}.json

* ``launch(*args, timeout=..., env=None, cwd=None)`` runs ``python -m hasten.cli launch
  *args`` and returns the ``subprocess.CompletedProcess`` (text stdout/stderr captured). A hang
  raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds, which fails the test.
* ``start_launch(*args, env=None, cwd=None, **popen)`` starts the same command without waiting
  (``subprocess.Popen``, output piped unless ``popen`` says otherwise) for tests that signal the
  launcher or run two at once.
* ``launch_env(**extra)`` is the environment both use: the caller's, without launcher,
  ``HASTEN_*``, ``ACCELERATE_*``, ``PARALLELISM_CONFIG_*`` and ``FSDP_*`` variables, with
  ``OMP_NUM_THREADS=1`` and ``HASTEN_CONFIG_HOME`` and ``HF_HOME`` pointing into an empty temporary
  folder (so neither hasten's config file nor Accelerate's default one in the real home is read),
  plus ``extra``.
* ``free_port()`` is a TCP port free on 127.0.0.1 right now (for ``--main_process_port``).
* ``read_ranks(folder, n)`` loads ``rank0.json .. rank{n-1}.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parent
SCRIPTS = TESTS / "scripts"

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
#: variables that set up a run (the launcher's, hasten's, Accelerate's, its parallelism and FSDP settings)
_SETTINGS_PREFIXES = ("HASTEN_", "ACCELERATE_", "TORCHELASTIC_", "PET_", "PARALLELISM_CONFIG_", "FSDP_")
_empty_config_home: str | None = None


def _config_home() -> str:
    global _empty_config_home
    if _empty_config_home is None:
        _empty_config_home = tempfile.mkdtemp(prefix="hasten-test-config-")
        atexit.register(shutil.rmtree, _empty_config_home, True)
    return _empty_config_home


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SETTINGS_PREFIXES) and k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["HASTEN_CONFIG_HOME"] = _config_home()
    env["HF_HOME"] = os.path.join(_config_home(), "huggingface")  # Accelerate's default config file: none
    env.update(extra)
    return env


def _command(args: tuple[Any, ...]) -> list[str]:
    return [sys.executable, "-m", "hasten.cli", "launch", *map(str, args)]


def launch(
    *args: Any, timeout: float = 180, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``hasten launch *args`` to the end (or raise TimeoutExpired after ``timeout`` s)."""
    return subprocess.run(
        _command(args), env=env or launch_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def start_launch(
    *args: Any, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None, **popen: Any
) -> subprocess.Popen:
    """Start ``hasten launch *args`` without waiting; the caller must wait with a timeout.

    ``popen`` goes to ``subprocess.Popen`` (e.g. ``stdout=file`` or ``start_new_session=True``);
    by default stdout and stderr are pipes."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(_command(args), env=env or launch_env(), cwd=cwd, **popen)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_ranks(folder: str | os.PathLike, n: int) -> list[dict]:
    return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(n)]
