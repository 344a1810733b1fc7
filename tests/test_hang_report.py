"""A hung job says which rank did not arrive and where each rank was (hasten.cli._stacks).

Real 2-process launches: a collective that times out (DDP, rank 1 asleep before ``backward``),
ranks in different collectives (FSDP2 forward on the main process only, the other rank in
``end_training``'s barrier), and Ctrl-C of stuck jobs, which must end within a few seconds
(torch's agent would wait 30 s for ranks blocked in a collective). Then the pieces, offline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hasten.cli import _stacks
from launch_utils import SCRIPTS, launch, launch_env, start_launch

TIMEOUT = 15  # seconds of InitProcessGroupKwargs(timeout=...) in the scripts that time out
STARTUP = 25  # generous: two interpreters importing torch on 2 busy cores


def line_of(script: str, text: str) -> int:
    """The number of the (first) line of tests/scripts/``script`` that contains ``text``."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def report(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hasten launch: ")]


def test_the_rank_that_did_not_reach_the_collective_is_named_first(tmp_path):
    start = time.monotonic()
    proc = launch("--num_processes", "2", "--log_dir", tmp_path / "logs", SCRIPTS / "hang_ddp.py", TIMEOUT, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "step done" not in proc.stdout
    assert elapsed < 2 * TIMEOUT + STARTUP, elapsed
    lines = report(proc.stderr)
    sleep, backward = line_of("hang_ddp.py", "time.sleep(600)"), line_of("hang_ddp.py", "accelerator.backward(loss)")
    first = lines[0]
    assert first.startswith(
        f"hasten launch: rank 1 did not reach the collective that rank 0 waited in for {TIMEOUT} s "
    ), proc.stderr[-4000:]
    assert first.endswith(
        f"rank 1 was at {Path(SCRIPTS, 'hang_ddp.py').relative_to(Path.cwd())}:{sleep} in <module>: time.sleep(600)"
    )
    rank0 = next(line for line in lines if line.startswith("hasten launch: rank 0 was at "))
    assert f"hang_ddp.py:{backward} in <module>: accelerator.backward(loss), waiting in backward" in rank0
    assert f"gave up after {TIMEOUT} s" in rank0
    # What the summary said before stays, after the account of the hang.
    assert "hasten launch: rank 0 failed first: it exited with code 1" in proc.stderr
    assert "rank 1 also failed: it was killed by signal SIGTERM (exit code -15), stopped by the launcher" in proc.stderr
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert (
        "every thread's stack of rank 1 when the launcher stopped it" in log
        and f'hang_ddp.py", line {sleep} in <module>' in log
    )


@pytest.mark.slow  # > 20 s: make test-slow
def test_ranks_waiting_in_different_collectives_are_each_shown_with_their_line():
    start = time.monotonic()
    proc = launch("--num_processes", "2", SCRIPTS / "hang_generate.py", TIMEOUT, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "generated" not in proc.stdout
    assert elapsed < 2 * TIMEOUT + STARTUP, elapsed
    forward = line_of("hang_generate.py", "sample = generator(")
    end = line_of("hang_generate.py", "accelerator.end_training()")
    first = report(proc.stderr)[0]
    assert first.startswith("hasten launch: the ranks were waiting in different collectives: rank 0 in all_gather"), (
        proc.stderr[-4000:]
    )
    assert f"hang_generate.py:{forward} (sample = generator(torch.ones(1, 8)))" in first
    assert f"rank 1 in barrier at tests/scripts/hang_generate.py:{end} (accelerator.end_training())" in first


def _interrupt(tmp_path: Path, script: str, *args: object) -> tuple[subprocess.Popen, str, float]:
    """Start a 2-process job in a process group of its own, wait until both ranks are about to
    hang, press Ctrl-C (SIGINT to the group, as a terminal does): the launcher, its stderr, and
    the seconds from the signal to its end."""
    (tmp_path / "tmp").mkdir()
    env = launch_env(TMPDIR=str(tmp_path / "tmp"))  # where the launcher's temporary log folder goes
    launcher = start_launch("--num_processes", "2", SCRIPTS / script, *args, tmp_path, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        time.sleep(1.5)  # into the collective (or the sleep)
        os.killpg(launcher.pid, signal.SIGINT)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        return launcher, err, time.monotonic() - start
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)


def test_ctrl_c_says_where_each_rank_was(tmp_path):
    launcher, err, elapsed = _interrupt(tmp_path, "hang_barrier.py")
    assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
    assert elapsed < 6, elapsed
    lines = report(err)
    barrier, sleep = line_of("hang_barrier.py", "wait_for_everyone()"), line_of("hang_barrier.py", "time.sleep(600)")
    assert lines[0] == (
        "hasten launch: rank 1 had not reached the collective that rank 0 was waiting in; "
        f"rank 1 was at tests/scripts/hang_barrier.py:{sleep} in <module>: time.sleep(600)"
    ), err[-3000:]
    assert lines[1].startswith(
        f"hasten launch: rank 0 was at tests/scripts/hang_barrier.py:{barrier} in <module>: "
        "accelerator.wait_for_everyone(), waiting in barrier (torch/distributed/distributed_c10d.py:"
    )
    assert lines[-1] == "hasten launch: stopped by SIGINT; all workers were stopped"
    assert os.listdir(tmp_path / "tmp") == []  # every rank ended by itself: the logs go, as after any stop


def test_ctrl_c_of_ranks_stuck_in_collectives_ends_within_seconds(tmp_path):
    # Neither rank can see a SIGINT (both are blocked in gloo): torch's agent alone waits 30 s.
    launcher, err, elapsed = _interrupt(tmp_path, "hang_generate.py", 0)
    assert launcher.returncode == 128 + signal.SIGINT, err[-3000:]
    assert elapsed < 6, elapsed
    forward = line_of("hang_generate.py", "sample = generator(")
    end = line_of("hang_generate.py", "accelerator.end_training()")
    first = report(err)[0]
    assert first.startswith("hasten launch: the ranks were waiting in different collectives: rank 0 in all_gather"), err
    assert (
        f"hang_generate.py:{forward} (sample" in first
        and f"rank 1 in barrier at tests/scripts/hang_generate.py:{end}" in first
    )
    assert "hasten launch: stopped by SIGINT; all workers were stopped" in err
    # Both ranks had to be killed: the log folder stays, with every thread's stack of each rank.
    logs = next(line for line in report(err) if "every thread's stack of each rank: " in line).split(": ")[-1]
    assert Path(logs).parent.parent == tmp_path / "tmp"
    assert f'hang_generate.py", line {end} in <module>' in (Path(logs).parent / "rank1.log").read_text()


# ---------------------------------------------------------------------------------- offline


def test_a_stack_file_and_errors_are_read_as_places(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time\n\ndef main():\n    time.sleep(600)  # wait\n")
    stack = tmp_path / "stack.txt"
    stack.write_text(
        "hasten: rank 3, pid 10, main thread 0x00007f0000000001\n"
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        f'  File "{script}", line 4 in main\n'
        f'  File "{script}", line 6 in <module>\n'
    )
    found = _stacks.read_stack(str(stack))
    assert found.rank == 3 and found.pid == 10
    assert [(f.line, f.func) for f in found.frames] == [(4, "main"), (6, "<module>")]  # the main thread's
    assert "threading.py" in found.dump and found.frames[0].code() == "time.sleep(600)"  # without its comment
    assert _stacks.read_stack(str(tmp_path / "missing.txt")) is None
    nccl = (
        "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600083 milliseconds before timing out."
    )
    assert _stacks.place_from_error(0, nccl, "").timed_out_ms == 600000
    peer = _stacks.place_from_error(1, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1", "")
    assert peer.waiting and peer.timed_out_ms is None
    gloo = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"
    waited = _stacks.place_from_error(
        0, gloo, f'Traceback (most recent call last):\n  File "{script}", line 4, in main\n'
    )
    assert _stacks.hang_lines([waited, _stacks.Place(1, [])])[0] == (  # rank 1 was stopped but wrote no stack
        f"rank 0 waited in a collective at {_stacks._shown(str(script))}:4 (time.sleep(600)) for 15 s (the process "
        "group's timeout, InitProcessGroupKwargs(timeout=...)); rank 1 did not say where it was (it wrote no stack: "
        "killed outright, or a signal handler of the script's own replaced the one that writes it)"
    )
    # A rank that failed on its own and a peer that lost it: no hang to report.
    assert _stacks.hang_lines([peer, _stacks.place_from_error(0, "ValueError: bad", "")]) == []


@pytest.mark.parametrize("stopped", [False, True])
def test_ranks_outside_any_collective_give_no_hang_report(tmp_path, stopped):
    frames = [_stacks.Frame(str(tmp_path / "train.py"), 4, "main")]
    places = [_stacks.Place(0, frames, stack=True), _stacks.Place(1, frames, stack=True)]
    assert _stacks.hang_lines(places, stopped=stopped) == []
