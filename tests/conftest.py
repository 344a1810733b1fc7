"""Shared test helpers: run a script on 2 processes with hasten launch (torch.distributed.run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SCRIPTS = TESTS / "scripts"
sys.path.insert(0, str(SCRIPTS))

from launch_utils import free_port, launch_env  # noqa: E402

clean_env = launch_env  # the environment of child processes: no launcher or HASTEN_* variables


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None):
    """Run ``script`` on ``nproc`` processes with ``hasten launch`` (torch.distributed.run inside).

    Through hasten's launcher rather than bare ``python -m torch.distributed.run``: its workers
    exit in order (see hasten.cli._child), so a gloo thread is never killed in the
    interpreter's teardown ("terminate called without an active exception", SIGABRT), which
    a bare torchrun worker still risks now and then on a loaded machine.
    """
    cmd = [
        sys.executable,
        "-m",
        "hasten.cli",
        "launch",
        "--num_processes",
        str(nproc),
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return subprocess.run(cmd, env=env or launch_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests run as one plain process, whatever the shell exported."""
    for key in list(os.environ):
        if key.startswith("HASTEN_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(key)
