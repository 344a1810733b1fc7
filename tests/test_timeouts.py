"""Every process group hasten makes, and every wait of the loop for hasten's background work,
honours ``InitProcessGroupKwargs(timeout=...)`` (issue 38, items 3 and 4).

Two launches (tests/scripts/timeout_hang.py) with a 15 s timeout, where one rank stops: HSDP 2x2
on 4 gloo processes (rank 3 sleeps before its forward) and FSDP2 on 2 with an asynchronous save
(rank 1 freezes itself with SIGSTOP, its writer thread with it). Before any rank stops, each
writes the timeout of every group its run holds: every one must be the user's. The rest runs
here, on one process, with the run's timeout made short.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch

import hasten.distributed.state
import hasten.settings.groups
from hasten import Accelerator
from hasten.checkpoint import background
from launch_utils import SCRIPTS, free_port, launch_env, start_launch

SCRIPT = SCRIPTS / "timeout_hang.py"
TIMEOUT = 15  # seconds, the runs' InitProcessGroupKwargs.timeout
STARTUP = 30  # seconds: the launcher, 2 or 4 interpreters importing torch on 2 shared cores, one step


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run(out, mode: str, n: int, limit: float) -> dict:
    """Launch ``mode`` on ``n`` processes and watch it: what each rank wrote, when each rank that
    did not stop and the launch ended (seconds after the stop; None: still running at ``limit``),
    the launch's status and output.

    A group with another timeout than the user's means a hang of up to 30 minutes: the launch is
    ended as soon as a rank reports one (``aborted``), so that test fails at once. A SIGSTOPped
    rank is continued by the launcher after its stop signal (``hasten.cli._failures.ContinueStopped``),
    so it says where it was and ends with the others.
    """
    begin = time.monotonic()
    launcher = start_launch(
        "--num_processes", str(n), "--cpu", "--main_process_port", str(free_port()), SCRIPT, out, mode, str(TIMEOUT)
    )
    family: dict[int, psutil.Process] = {}
    ranks: list[dict] = []
    ended: dict[int, float] = {}
    aborted = launch_ended = None
    try:
        while time.monotonic() - begin < limit and launcher.poll() is None and aborted is None:
            family.update((p.pid, p) for p in psutil.Process(launcher.pid).children(recursive=True))
            if not ranks and all((out / f"rank{r}.json").exists() for r in range(n)):
                time.sleep(0.2)  # written whole
                ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
                stopped = max(r["time"] for r in ranks)
                wrong = {k: t for r in ranks for k, t in r["timeouts"].items() if t != TIMEOUT}
                aborted = f"groups with another timeout than {TIMEOUT} s: {wrong}" if wrong else None
            for r, rec in enumerate(ranks):
                if r not in ended and _ended(rec["pid"]):
                    ended[r] = time.time() - stopped
            time.sleep(0.2)
        if launcher.poll() is not None and ranks:
            launch_ended = time.time() - stopped
    finally:
        for p in [launcher, *family.values()]:  # a hang: stop what this test started (a stopped rank too)
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass
    stdout, stderr = launcher.communicate(timeout=60)
    return {
        "ranks": ranks,
        "ended": ended,
        "launch_ended": launch_ended,
        "elapsed": time.monotonic() - begin,
        "returncode": launcher.returncode if launch_ended is not None else None,
        "output": stdout + stderr,
        "aborted": aborted,
    }


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("hsdp"), "hsdp", 4, limit=150)


@pytest.fixture(scope="module")
def async_save(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("async"), "async", 2, limit=150)


def test_every_group_of_an_hsdp_mesh_and_the_async_save_group_has_the_users_timeout(hsdp, async_save):
    """Each mesh dim (size 2, and size 1), the flattened dp / dp_shard_cp / dp_cp, FSDP's meshes
    and the asynchronous saves' gloo group: none with torch's 30-minute default."""
    expected = {
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "sp",
        "tp",
        "dp",
        "dp_shard_cp",
        "dp_cp",
        "fsdp_0",
        "fsdp_1",
        "async_save",
    }
    assert len(hsdp["ranks"]) == 4 and len(async_save["ranks"]) == 2, (
        hsdp["output"][-3000:] + async_save["output"][-3000:]
    )
    for rec in hsdp["ranks"]:
        assert set(rec["timeouts"]) == expected
        assert rec["timeouts"] == dict.fromkeys(expected, TIMEOUT), rec["timeouts"]
    for rec in async_save["ranks"]:
        assert rec["timeouts"] == {"fsdp_0": TIMEOUT, "async_save": TIMEOUT}, rec["timeouts"]


def _line_of(code: str) -> int:
    """The line of the script where ``code`` is."""
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if code in line)


def _reported(run: dict) -> list[str]:
    return [line for line in run["output"].splitlines() if line.startswith("hasten launch: rank")]


def _times(run: dict) -> str:
    return (
        f"ended after the stop: ranks {run['ended']}, the launch {run['launch_ended']}; {run['elapsed']:.0f} s in all"
    )


def _started(run: dict, n: int) -> None:
    assert len(run["ranks"]) == n, run["output"][-4000:]
    assert run["aborted"] is None, run["aborted"]
    assert run["launch_ended"] is not None, f"still running {run['elapsed']:.0f} s after the launch: {run['ended']}"


def test_hsdp_with_a_rank_asleep_fails_after_the_timeout(hsdp):
    _started(hsdp, 4)
    assert hsdp["returncode"] != 0, hsdp["output"][-4000:]
    assert "trained past the stopped rank" not in hsdp["output"]
    assert "timed out" in hsdp["output"].lower() or "timeout" in hsdp["output"].lower()
    # the ranks waiting for rank 3 fail after the timeout (a second one for those whose peer failed)
    assert hsdp["launch_ended"] < 2 * TIMEOUT + 15, _times(hsdp)
    assert hsdp["elapsed"] < 2 * TIMEOUT + STARTUP + 15, _times(hsdp)
    # the launcher's first line names the rank that never arrived, and where it was in the script
    first = _reported(hsdp)[0]
    assert first.startswith("hasten launch: rank 3 did not reach the collective"), hsdp["output"][-4000:]
    assert f"timeout_hang.py:{_line_of('time.sleep(600)')}" in first, first


def test_a_rank_frozen_after_an_async_save_does_not_hang_the_others(async_save):
    """Rank 0's loop fails after the timeout, its writer thread too (its group has the timeout),
    so rank 0 ends; the launcher continues the frozen rank 1 after its stop signal, so it says where
    it was and ends too."""
    _started(async_save, 2)
    assert async_save["returncode"] != 0, async_save["output"][-4000:]
    assert "trained past the stopped rank" not in async_save["output"]
    assert "timed out" in async_save["output"].lower() or "timeout" in async_save["output"].lower()
    assert 0 in async_save["ended"] and async_save["ended"][0] < 2 * TIMEOUT + 10, _times(async_save)
    assert async_save["launch_ended"] < 2 * TIMEOUT + 15, _times(async_save)  # the frozen rank 1 too
    first = _reported(async_save)[0]
    assert "rank 1 did not reach the collective" in first, async_save["output"][-4000:]
    # it says where once the launcher continued it: at the SIGSTOP, or a few lines on by then; its
    # main thread may already be ending when its stack is written (a race: "no Python frame")
    assert "rank 1 was frozen (stopped by SIGSTOP or a debugger)" in first, first
    assert "timeout_hang.py:" in first or "an unknown place (no Python frame)" in first, first


# ---------------------------------------------------------------------- here, on one process


_ONE_PROCESS_MESH = """
import json, os, sys, datetime, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=7))
from torch.distributed.device_mesh import init_device_mesh
from hasten.settings import groups
torch.cuda.is_available = lambda: True  # torch then makes a new group for a dim over every process
seen = {"world": groups.group_timeout().total_seconds(),
        "torch_cuda_gloo": groups.timeout_of(init_device_mesh("cpu", (1,)).get_group()).total_seconds()}
mesh = groups.init_mesh("cpu", (1, 1), ("a", "b"))
seen["mesh"] = [groups.timeout_of(g).total_seconds() for g in mesh.get_all_groups()]
seen["flat"] = groups.timeout_of(groups.flatten_mesh(mesh, "ab").get_group()).total_seconds()
print(json.dumps(seen))
"""


def test_a_group_torch_makes_with_its_default_timeout_gets_the_runs():
    """Where CUDA is there and the default group is gloo, torch's DeviceMesh makes a new group for
    a dim over every process with its 30-minute default (whatever the options): init_mesh and
    flatten_mesh give it the run's timeout after."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS_MESH, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["world"] == 7 and seen["torch_cuda_gloo"] == 1800  # what torch alone gives
    assert seen["mesh"] == [7, 7] and seen["flat"] == 7


def test_without_a_process_group_there_is_no_timeout_and_the_error_names_the_handler():
    assert hasten.settings.groups.group_timeout() is None  # one process: nothing to wait for from others
    err = hasten.distributed.state.timeout_error("the asynchronous save_state of '/x/ck'", timedelta(seconds=20))
    assert isinstance(err, TimeoutError)
    assert str(err).startswith(
        "the asynchronous save_state of '/x/ck' did not finish within the 20 s timeout (InitProcessGroupKwargs.timeout)"
    )


@pytest.fixture
def short_timeout(monkeypatch):
    """The run's timeout made 0.5 s (as if a process group had it), for the loop's waits."""

    def short() -> timedelta:
        return timedelta(seconds=0.5)

    monkeypatch.setattr(hasten.settings.groups, "group_timeout", short)  # read by the waits when they wait


def _one(tmp_path):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    return acc, model, opt


def test_waits_for_a_stuck_writer_raise_after_the_timeout_and_keep_it_in_flight(tmp_path, monkeypatch, short_timeout):
    acc, model, opt = _one(tmp_path)
    gate = threading.Event()
    monkeypatch.setattr(background, "before_write", lambda tmp: gate.wait(60))
    target = str(tmp_path / "ck")
    acc.save_state(target, async_save=True)
    for wait in (acc.wait_for_checkpoint, lambda: acc.save_state(str(tmp_path / "ck2"), async_save=True),
                 lambda: acc.load_state(target), acc.end_training):  # fmt: skip
        start = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=r"the asynchronous save_state of '.*ck' did not finish within the "
            r"0.5 s timeout \(InitProcessGroupKwargs.timeout\)",
        ):
            wait()
        assert time.monotonic() - start < 5
        assert acc._checkpointer.background.pending is not None  # still in flight: nothing else started under it
    assert acc._checkpointer.background.stager is not None  # end_training kept the host copy the thread writes from
    assert not (tmp_path / "ck2").exists()
    gate.set()
    acc.wait_for_checkpoint()  # the save finishes and is waited for as usual
    assert (tmp_path / "ck" / "hasten_checkpoint.json").is_file()
    acc.end_training()
    assert acc._checkpointer.background.stager is None


def test_a_step_waiting_for_a_stuck_copy_raises_after_the_timeout(tmp_path, monkeypatch, short_timeout):
    acc, model, opt = _one(tmp_path)
    gate = threading.Event()
    monkeypatch.setattr(background, "before_stage", lambda: gate.wait(60))
    acc.save_state(str(tmp_path / "ck"), async_save=True)
    model(torch.randn(2, 4)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"the asynchronous save_state of '.*ck' \(its copy of the weights and "
        r"optimizer state, waited for here\) did not finish within the 0.5 s",
    ):
        opt.step()
    assert time.monotonic() - start < 5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the step changed nothing
    assert acc._checkpointer.barrier.events  # what the next step waits for
    gate.set()
    opt.step()
    assert not acc._checkpointer.barrier.events
    acc.wait_for_checkpoint()
    acc.end_training()


def test_no_wait_without_a_save_in_flight(tmp_path, monkeypatch):
    """The hot path: a step with nothing in flight does not even read the timeout."""

    def never() -> timedelta:
        raise AssertionError("read the timeout with nothing in flight")

    acc, model, opt = _one(tmp_path)
    monkeypatch.setattr(hasten.settings.groups, "group_timeout", never)
    barrier = acc._checkpointer.barrier
    assert not barrier.events and opt._in_flight is barrier.events  # the step tests the barrier's own list
    barrier.wait()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
