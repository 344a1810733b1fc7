"""The exit stress test without the launcher's cost: import torch and hasten once, then fork the
two workers of each run (tests/scripts/exit_job.py under hasten.cli._child, as `hasten launch`
runs it). A run costs a fraction of a second instead of three interpreter starts, so hundreds of
runs take minutes on 2 cores; the exit itself is the real one (the worker's own interpreter
shutdown, or _child's). tests/exit_stress.py is the same through `hasten launch`.

usage: python tests/exit_fork_stress.py RUNS [PARALLEL] [save]

Prints one line per failed run and a JSON summary (ok / abort / error / hang counts) last;
exit status 1 if any run failed. A worker still running after EXIT_STRESS_HANG_S seconds (180)
is killed and counted as hung.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401 - imported once, before the forks
import torch.distributed  # noqa: F401
import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
import torch.nn.parallel  # noqa: F401

import hasten  # noqa: F401
import hasten.checkpoint  # noqa: F401
import hasten.cli._child  # noqa: F401
import hasten.distributed.state  # noqa: F401
import hasten.settings.comm_hooks  # noqa: F401
from hasten import Accelerator  # noqa: F401

SCRIPT = str(Path(__file__).parent / "scripts" / "exit_job.py")
HANG_S = float(os.environ.get("EXIT_STRESS_HANG_S", "180"))  # generous: a loaded 2-core machine starves workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(rank: int, port: int, out: Path, save: bool) -> int | None:
    """Fork one worker; in the child, run the job and end the way the worker process ends."""
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HASTEN_USE_CPU="true", OMP_NUM_THREADS="1",
        TORCHELASTIC_ERROR_FILE=str(out / str(rank) / "error.json"),
    )  # fmt: skip
    (out / str(rank)).mkdir(parents=True, exist_ok=True)
    log = os.open(out / str(rank) / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # What `python -m hasten.cli._child exit_job.py OUT` runs, its `if __name__ == "__main__"` included.
    sys.argv = ["-m", SCRIPT, str(out)] + (["save"] if save else [])
    runpy.run_module("hasten.cli._child", run_name="__main__", alter_sys=True)
    return None  # the caller returns from the module: the interpreter exits as after `python -m ...`


def wait_all(pids: list[int], deadline: float) -> list[int | None]:
    """Each worker's raw wait status, None if it was still running at the deadline (then killed)."""
    statuses: dict[int, int | None] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    statuses[pid] = None
        time.sleep(0.01)
    return [statuses[p] for p in pids]


def classify(statuses: list[int | None], out: Path) -> tuple[str, str]:
    text = "".join(
        (out / str(r) / "output.txt").read_text(errors="replace")
        for r in range(2)
        if (out / str(r) / "output.txt").exists()
    )
    for r in range(2):
        fault = out / str(r) / "fault.txt"
        if fault.exists() and fault.stat().st_size:
            text += f"\n--- rank {r} fault.txt\n" + fault.read_text(errors="replace")
    if any(s is None for s in statuses):
        return "hang", text
    signalled = [os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGABRT for s in statuses]
    if any(signalled) or "terminate called" in text:
        return "abort", text
    if any(os.waitstatus_to_exitcode(s) != 0 for s in statuses):
        return "error", text
    return "ok", text


def main() -> None:
    runs = int(sys.argv[1])
    parallel = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    save = "save" in sys.argv[3:]
    root = Path(tempfile.mkdtemp(prefix="hasten-exit-fork-"))
    counts = {"ok": 0, "abort": 0, "error": 0, "hang": 0}
    start = time.monotonic()
    running: list[tuple[int, list[int], Path, float]] = []
    next_run = 0
    try:
        while next_run < runs or running:
            while next_run < runs and len(running) < parallel:
                out = root / f"run{next_run}"
                port = free_port()
                pids = []
                for rank in range(2):
                    pid = start_worker(rank, port, out, save)
                    if pid is None:
                        return  # in a worker: leave main(), then the module, then the interpreter
                    pids.append(pid)
                running.append((next_run, pids, out, time.monotonic() + HANG_S))
                next_run += 1
            index, pids, out, deadline = running.pop(0)
            kind, text = classify(wait_all(pids, deadline), out)
            counts[kind] += 1
            if sum(counts.values()) % 25 == 0:
                print(f"{sum(counts.values())} runs: {counts}", file=sys.stderr, flush=True)
            if kind != "ok":
                print(f"run {index}: {kind}\n{text[-2500:]}\n", file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if os.getpid() == PARENT:
            shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {"runs": runs, "parallel": parallel, "save": save, **counts, "seconds": round(time.monotonic() - start, 1)}
        )
    )
    if counts["ok"] != runs:
        sys.exit(1)


PARENT = os.getpid()
if __name__ == "__main__":
    main()
