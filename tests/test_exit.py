"""How a worker ends (issue 16, "Abort at exit").

A two-process run sometimes ended with ``terminate called without an active exception``
(SIGABRT, status 134) after the script had returned: a gloo worker thread letting go of a
finished collective's tensors took the GIL while the interpreter was finalizing, was ended by
``pthread_exit``, and the unwinding through a C++ destructor called std::terminate. The worker
wrapper (hasten.cli._child) now ends the process in order while the interpreter is whole and
leaves with ``os._exit``; these tests pin that down.

* The ordered exit keeps what the interpreter's exit gives a script: the exit status of
  ``sys.exit``, atexit handlers, non-daemon threads joined, buffered files written.
* A run made to hit the race every time (tests/scripts/exit_gloo_thread.py: a gloo thread runs
  a Python callback while rank 0's interpreter is in its teardown) exits with status 0.
* The smallest real job (group, DDP model, one step, save_state) run 10 times, 3 at once,
  exits cleanly every time (tests/exit_fork_stress.py); `make soak-exit` runs 200 of them and
  20 through `hasten launch` itself (tests/exit_stress.py), marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch_utils import SCRIPTS, launch, launch_env

TESTS = Path(__file__).parent
TWO_CPU = ("--num_processes", "2", "--cpu")


def run_child(tmp_path: Path, source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "hasten.cli._child", str(script)],
        cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("ending", "status"), [("pass", 0), ("sys.exit(3)", 3), ("sys.exit(None)", 0), ("sys.exit(256 + 7)", 7)]
)
def test_the_exit_status_is_the_scripts(tmp_path, ending, status):
    proc = run_child(tmp_path, f"import sys\n{ending}\n")
    assert proc.returncode == status, proc.stderr


def test_sys_exit_with_a_message_prints_it_and_exits_1(tmp_path):
    proc = run_child(tmp_path, "import sys\nsys.exit('no data')\n")
    assert proc.returncode == 1 and proc.stderr.strip() == "no data"


def test_atexit_handlers_threads_and_buffered_files_are_kept(tmp_path):
    proc = run_child(
        tmp_path,
        """
        import atexit, threading, time
        log = open("log.txt", "w")           # never closed: the interpreter's exit would flush it
        log.write("written")
        def late():
            time.sleep(0.3)
            open("thread.txt", "w").write("joined")
        threading.Thread(target=late).start()  # non-daemon: waited for before the atexit handlers
        atexit.register(lambda: print("first registered, last run", flush=True))
        atexit.register(lambda: 1 / 0)       # a failing handler is reported, the others still run
        atexit.register(lambda: print("atexit ran", open("thread.txt").read()))
        print("script done")
    """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["script done", "atexit ran joined", "first registered, last run"]
    assert "ZeroDivisionError" in proc.stderr
    assert (tmp_path / "log.txt").read_text() == "written"


def test_an_exception_still_exits_1_with_its_traceback(tmp_path):
    proc = run_child(tmp_path, "raise ValueError('bad input')\n")
    assert proc.returncode == 1 and "ValueError: bad input" in proc.stderr


def test_a_gloo_thread_needing_the_gil_at_exit_does_not_abort_the_worker(tmp_path):
    """Before the ordered exit this run ended with SIGABRT every time (see the script)."""
    proc = launch(*TWO_CPU, SCRIPTS / "exit_gloo_thread.py", timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr


def stress(runs: int, parallel: int, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, str(TESTS / "exit_fork_stress.py"), str(runs), str(parallel), "save"],
        env=launch_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and summary.get("ok") == runs, f"{summary}\n{proc.stderr[-6000:]}"
    return summary


@pytest.mark.slow  # > 20 s: make test-slow
def test_ten_two_process_jobs_all_exit_cleanly():
    stress(10, 3, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(3700)  # pytest-timeout's default (300 s, pyproject) would end it first
def test_two_hundred_two_process_jobs_all_exit_cleanly():
    stress(200, 3, timeout=3600)


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_twenty_launches_all_exit_cleanly():
    """Through `hasten launch` itself: the elastic agent, its store, the per-attempt store."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "exit_stress.py"), "--runs", "20", "--parallel", "3", "--save"],
        env=launch_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] == 20
