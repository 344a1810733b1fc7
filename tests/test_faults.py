"""Faults through `hasten launch` on 2 gloo processes: the run ends at once, says which rank
failed first, leaves no process or temporary file behind, and a checkpointed run survives.

Covered elsewhere, not repeated here (tests/test_cli.py): a rank raising right at start
(`test_a_crashing_rank_stops_the_run_and_is_named`), a rank hung in a collective failing after
the InitProcessGroupKwargs timeout (`test_a_hung_collective_fails_after_the_process_group_timeout`),
SIGTERM/SIGINT to the launcher while the workers sleep (`test_a_signal_to_the_launcher_stops_every_worker`).

Here: a rank raising mid-step and inside the gradient all-reduce; SIGTERM to the launcher and
Ctrl-C to the whole process group while the workers train with DataLoader worker processes;
SIGKILL of a rank halfway through save_state; `--max_restarts 1` after a crash and after that
SIGKILL, resuming to the same final weights as an uninterrupted run.

Every launch has a timeout: the surviving rank of a failure would otherwise wait 30 minutes
in its collective, so a run that ends at all ended because the launcher stopped it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from launch_utils import SCRIPTS, launch, launch_env

LAUNCH_TIMEOUT = 180
# 2 processes: one per GPU with 2 GPUs or more, else gloo on CPU (one GPU cannot host two NCCL ranks).
TWO = ("--num_processes", "2", *(() if torch.cuda.device_count() >= 2 else ("--cpu",)))


def leftovers(tmpdir: Path) -> list[str]:
    """What a run left in its TMPDIR, apart from torch's own compile cache (torch.optim creates it)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def run_env(tmp_path: Path) -> dict[str, str]:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return launch_env(TMPDIR=str(tmpdir))


# ---------------------------------------------------------------------- a rank raising


@pytest.mark.parametrize(
    "where, message",
    [
        # mid-step is also test_cli.py's test_a_crashing_rank_stops_the_run_and_is_named: here in make test-slow
        pytest.param("step", "RuntimeError: boom mid-step on rank 1", marks=pytest.mark.slow),
        ("collective", "RuntimeError: boom inside the gradient all-reduce on rank 1"),
    ],
)
def test_a_rank_raising_mid_step_or_in_a_collective_ends_the_run(where, message, tmp_path):
    proc = launch(*TWO, SCRIPTS / "fault_raise.py", where, env=run_env(tmp_path), timeout=120)
    err = proc.stderr
    assert proc.returncode == 1, err[-4000:]
    assert "hasten launch: rank 1 failed first: it exited with code 1" in err, err[-4000:]
    summary = err[err.index("hasten launch: rank 1 failed first") :]
    assert "---- traceback of rank 1 ----" in summary and 'fault_raise.py", line' in summary
    assert message in summary
    assert "hasten launch: rank 0 also failed" in summary and "the other workers were stopped" in summary
    assert summary.count("Traceback (most recent call last)") == 1  # rank 0's lost-peer error is in the logs only
    # The one thing left is the log folder the summary names (torch's error files, each rank's log).
    logs = summary.split("full logs of every rank: ")[1].split()[0]
    assert leftovers(tmp_path / "tmp") == [os.path.basename(logs)]
    assert message in (tmp_path / "tmp" / os.path.basename(logs) / "rank1.log").read_text()


# ---------------------------------------------------------------------- signals while training


def _start_in_own_group(*args: object, env: dict[str, str]) -> subprocess.Popen:
    """`hasten launch` as a shell starts it: the leader of its own process group (a terminal's Ctrl-C
    reaches the whole group)."""
    command = [sys.executable, "-m", "hasten.cli", "launch", *map(str, args)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize(
    "how",  # SIGTERM to the launcher is also test_cli.py's test_a_signal_to_the_launcher_stops_every_worker
    [pytest.param("SIGTERM to the launcher", marks=pytest.mark.slow), "Ctrl-C to the process group"],
)
def test_a_signal_while_training_leaves_no_process(how, tmp_path):
    env = run_env(tmp_path)
    launcher = _start_in_own_group(*TWO, SCRIPTS / "fault_busy.py", tmp_path, env=env)
    try:
        deadline = time.monotonic() + 150
        while not all((tmp_path / f"pids{r}.json").exists() for r in range(2)):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start training"
            time.sleep(0.2)
        pids = [json.loads((tmp_path / f"pids{r}.json").read_text()) for r in range(2)]
        family = psutil.Process(launcher.pid).children(recursive=True)
        in_family = {p.pid for p in family}
        for rank in pids:
            assert rank["rank"] in in_family and rank["loader_workers"], pids
            assert set(rank["loader_workers"]) <= in_family  # the loader workers are the launcher's grandchildren
        if how.startswith("SIGTERM"):
            sig = signal.SIGTERM
            os.kill(launcher.pid, sig)
        else:
            sig = signal.SIGINT
            os.killpg(launcher.pid, sig)
        _, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    assert launcher.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {sig.name}" in err
    _, alive = psutil.wait_procs(family, timeout=30)
    assert alive == [], f"left running: {alive}"
    # Nothing of the launcher's; a SIGTERMed Python process skips its atexit cleanup, so the
    # DataLoader's multiprocessing folders (pymp-*) may stay: that is Python's, not hasten's.
    assert [name for name in leftovers(tmp_path / "tmp") if not name.startswith("pymp-")] == []


# ---------------------------------------------------------------------- checkpoints and restarts


def _resume_run(out: Path, mode: str, *flags: str) -> list[dict]:
    out.mkdir()
    proc = launch(
        *TWO, *flags, SCRIPTS / "fault_resume.py", out, mode,
        env=run_env(out), timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert leftovers(out / "tmp") == []
    ranks = []
    for r in range(2):
        attempts = [json.loads(line) for line in (out / f"attempts_rank{r}.jsonl").read_text().splitlines()]
        assert len(attempts) == 1, attempts  # only the attempt that finished reached the end
        ranks.append(attempts[0])
    return ranks


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "straight"
    return out, _resume_run(out, "straight")


def _same_final_weights(a: Path, b: Path) -> None:
    for r in range(2):
        x, y = torch.load(a / f"final_rank{r}.pt"), torch.load(b / f"final_rank{r}.pt")
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), f"rank {r}: {k} differs from the uninterrupted run"


def test_the_uninterrupted_run(straight):
    _, ranks = straight
    for rec in ranks:
        assert rec["restart"] == 0 and rec["found"] == [] and "loaded" not in rec
        assert rec["end_step"] == 24 and rec["left"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2


def test_a_rank_crashing_once_restarts_resumes_and_finishes_identically(straight, tmp_path):
    out = tmp_path / "crash_once"
    ranks = _resume_run(out, "crash_once", "--max_restarts", "1")
    assert (out / "crashed").exists()  # rank 1 did crash, at step 13
    for rec in ranks:
        assert rec["restart"] == 1
        assert rec["found"] == ["checkpoint_0", "checkpoint_1"]
        assert rec["loaded"] == "checkpoint_1" and rec["loaded_step"] == 10  # the last checkpoint before the crash
        assert rec["loaded_weights_are_the_saved_ones"]
        assert rec["end_step"] == 24 and rec["left"] == ["checkpoint_2", "checkpoint_3"]
    _same_final_weights(straight[0], out)


def test_sigkill_during_save_state_keeps_the_previous_checkpoint_and_refuses_the_partial_one(straight, tmp_path):
    out = tmp_path / "kill_in_save"
    ranks = _resume_run(out, "kill_in_save", "--max_restarts", "1")
    assert (out / "killed").exists()  # rank 0 was SIGKILLed while writing the checkpoint of step 15
    for rec in ranks:
        assert rec["restart"] == 1
        partial = [name for name in rec["found"] if name.startswith(".checkpoint_2.tmp-")]
        assert len(partial) == 1 and [n for n in rec["found"] if n not in partial] == ["checkpoint_0", "checkpoint_1"]
        # The partial checkpoint: no manifest, a half-written optimizer file.
        assert rec["partial_has_manifest"] is False
        assert 0 < rec["partial_files"]["optimizer.bin"] < rec["complete_files"]["optimizer.bin"]
        assert "has no hasten_checkpoint.json" in rec["partial_refused"] and partial[0] in rec["partial_refused"]
        assert rec["unchanged_after_refusal"]  # refused before anything was restored
        assert rec["loaded"] == "checkpoint_1" and rec["loaded_step"] == 10 and rec["loaded_weights_are_the_saved_ones"]
        # load_state() said, in one line on the main process, which partial save it passed over and why.
        if rec["rank"] == 0:
            assert len(rec["passed_over"]) == 1 and "\n" not in rec["passed_over"][0], rec["passed_over"]
            assert f"passed over '{partial[0]}' (a save of 'checkpoint_2' that did not finish)" in rec["passed_over"][0]
            assert "loading 'checkpoint_1', the newest complete checkpoint" in rec["passed_over"][0]
        else:
            assert rec["passed_over"] == []
        # The next save of step 15 cleared the partial directory; total_limit kept the newest two.
        assert rec["end_step"] == 24 and rec["left"] == ["checkpoint_2", "checkpoint_3"]
    _same_final_weights(straight[0], out)


# ---------------------------------------------------------------------- one run per folder (issue 16, item 2)

_HOLDER = """
import sys, time, torch
from hasten import Accelerator
acc = Accelerator(project_dir=sys.argv[1])
acc.prepare(torch.nn.Linear(2, 2))
acc.save_state()
print("saved", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_the_same_project_dir_is_refused_until_the_first_ends(tmp_path):
    from hasten import Accelerator

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], env=launch_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "saved"
        acc = Accelerator(project_dir=tmp_path)
        acc.prepare(torch.nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match=rf"checkpoints' is in use by another run \(pid {holder.pid} on host "):
            acc.save_state()
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [
            ".hasten-lock",
            "checkpoint_0",
        ]  # the refusal wrote nothing
        holder.kill()  # a crash releases the lock: the operating system closes the holder's file
        holder.wait(timeout=30)
        assert acc.save_state().endswith("checkpoint_1")
        again = Accelerator(project_dir=tmp_path)  # another Accelerator of this same process may share it
        again.prepare(torch.nn.Linear(2, 2))
        assert again.save_state().endswith("checkpoint_2")
    finally:
        holder.kill()
        holder.wait(timeout=30)


# ---------------------------------------------------------------------- a full disk (issue 29, item 2)


def _mount_small_tmpfs(folder: Path) -> str | None:
    """Mount a 2 MiB tmpfs on ``folder``; the reason it could not be, else None."""
    folder.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount: {e}"
    return None if proc.returncode == 0 else f"mount -t tmpfs refused: {proc.stderr.strip() or proc.returncode}"


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def disk_full(request, tmp_path_factory):
    """One launch per layout ("full" through DDP, "dcp" through FSDP2): a save that fails on a file
    size limit (always) and on a full tmpfs (where mounting one is allowed)."""
    out = tmp_path_factory.mktemp(f"disk_full_{request.param}")
    (out / "fsize").mkdir()
    tmpfs = out / "tmpfs"
    refused = _mount_small_tmpfs(tmpfs)
    try:
        proc = launch(
            *TWO, SCRIPTS / "fault_disk_full.py", out, request.param, *(() if refused else (tmpfs,)),
            env=run_env(out), timeout=LAUNCH_TIMEOUT,
        )  # fmt: skip
    finally:
        if refused is None:
            subprocess.run(["umount", str(tmpfs)], timeout=30, check=False)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return request.param, proc, ranks, refused, out


def _check_refused_save(rec: dict, folder: str, os_error: str, file_name: str | None) -> None:
    """``file_name``: the file the OS refused, or None where any rank's file may be the one that
    met the full disk first (on a shared tmpfs, which one does is a race)."""
    err = rec["error"]
    assert err is not None, rec
    # the failing rank's CheckpointError; a rank that did not fail names it (the "full" layout's rank 1)
    assert err["type"] == "CheckpointError" or err["message"].startswith(
        "save_state (writing) failed on process 0: CheckpointError"
    ), err
    assert "Exception" in err["mro"]  # what `except Exception` catches (torch's CheckpointException is not)
    message = err["message"]
    assert f"cannot write the checkpoint '{folder}/b'" in message and os_error in message, message
    # the file being written when the OS refused
    written = re.search(r"'([^']*/\.b\.tmp-[0-9a-f]+/([^']+))'", message)
    assert written is not None, message
    assert file_name is None or written.group(2) == file_name, message
    assert "enforce fail" not in message and "Traceback" not in message
    assert rec["left"] == ["a"]  # the partial folder is gone
    assert rec["first_loads"]  # and the previous checkpoint is intact


def test_a_save_over_the_file_size_limit_names_the_os_error_and_the_file(disk_full):
    kind, proc, ranks, _, out = disk_full
    file_name = "model_0/__0_0.distcp" if kind == "fsdp" else "model.safetensors"
    for rec in ranks:
        _check_refused_save(rec["fsize"], str(out / "fsize"), "File too large [EFBIG]", file_name)
    if kind == "ddp":  # only rank 0 failed: rank 1 says so, with rank 0's own line
        assert ranks[1]["fsize"]["error"]["message"].startswith(
            "save_state (writing) failed on process 0: CheckpointError:"
        )
    # The console: the launcher's summary shows the one line, not torch's traceback or its C++ enforce.
    err = proc.stderr
    assert proc.returncode == 1, err[-4000:]
    assert (
        "failed with CheckpointError: save_state: cannot write the checkpoint" in err
        and "File too large [EFBIG]" in err
    )
    assert "enforce fail" not in err and "CheckpointException" not in err and "RANK 0" not in err


def test_a_save_onto_a_full_disk_names_the_os_error_and_the_file(disk_full):
    kind, _, ranks, refused, out = disk_full
    if refused:
        pytest.skip(f"no small tmpfs to fill: {refused} (the file size limit test covers the same path)")
    for rec in ranks:  # both ranks write to the one tmpfs: either may meet the full disk first
        _check_refused_save(rec["tmpfs"], str(out / "tmpfs"), "No space left on device [ENOSPC]", None)


_CLAIMER = """
import sys, time
from hasten import Accelerator, ProjectConfiguration
acc = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True))
print("claimed", flush=True)
time.sleep(120)
"""


def test_a_second_run_with_automatic_naming_is_refused_at_accelerator_before_any_work(tmp_path):
    """Issue 29, item 3: the folder is claimed by Accelerator(...), not at the first save_state."""
    import gc
    import socket

    from hasten import Accelerator, ProjectConfiguration
    from hasten.checkpoint import CheckpointError

    project = tmp_path / "project"
    holder = subprocess.Popen(
        [sys.executable, "-c", _CLAIMER, str(project)], env=launch_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"  # it has saved nothing yet
        assert sorted(os.listdir(project / "checkpoints")) == [".hasten-lock"]
        # A second run of 2 processes: both ranks stop at Accelerator(...), the console names the holder.
        out = tmp_path / "second"
        out.mkdir()
        proc = launch(*TWO, SCRIPTS / "fault_claimed_dir.py", project, out, env=run_env(out), timeout=120)
        err = proc.stderr
        assert proc.returncode == 1, err[-4000:]
        holder_line = f"is in use by another run (pid {holder.pid} on host {socket.gethostname()})"
        assert (
            f"CheckpointError: Accelerator: the checkpoint folder '{project / 'checkpoints'}' {holder_line}" in err
        ), err[-4000:]
        assert not list(out.glob("reached_rank*"))  # neither rank got past Accelerator(...)
        assert sorted(os.listdir(project / "checkpoints")) == [".hasten-lock"]  # the refusal wrote nothing
        # In this process too, as a CheckpointError (an Exception) before anything is prepared.
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        with pytest.raises(CheckpointError, match=re.escape(holder_line)):
            Accelerator(project_config=config)
        holder.kill()  # the holder's exit releases the folder
        holder.wait(timeout=30)
        acc = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
        del acc  # an Accelerator that is gone no longer holds the folder
        gc.collect()
        taken = subprocess.run(
            [sys.executable, "-c", _CLAIMER.replace("time.sleep(120)", ""), str(project)],
            env=launch_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert taken.returncode == 0 and taken.stdout.strip() == "claimed", taken.stderr[-3000:]
    finally:
        holder.kill()
        holder.wait(timeout=30)
