"""Run the smallest two-process job (tests/scripts/exit_job.py) many times through `hasten launch`
and count how each run ended: the check that a finished run always exits cleanly (issue 16,
"terminate called without an active exception", SIGABRT after the script returned).

usage: python tests/exit_stress.py [--runs N] [--parallel P] [--save] [--keep DIR]

P launches run at once (2 by default: on a small machine that is the CPU load that shakes
out races at exit). Every launch has a timeout; a run that hangs is killed and counted.
Prints one line per failed run and a JSON summary last; exit status 1 if any run failed.
`make soak-exit` runs 200; tests/test_exit.py runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_utils import SCRIPTS, launch_env, start_launch  # noqa: E402

ABORT_MARKS = ("terminate called", "SIGABRT", "Signals.SIGABRT", "exitcode: -6", "Fatal Python error")


def one_run(index: int, root: Path, save: bool, timeout: float) -> dict:
    out = root / f"run{index}"
    out.mkdir()
    args = ["--num_processes", "2", "--cpu", "--log_dir", out / "logs", SCRIPTS / "exit_job.py", out]
    if save:
        args.append("save")
    start = time.monotonic()
    proc = start_launch(*args, env=launch_env(TMPDIR=str(root)))
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGTERM)  # the launcher stops its workers on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        rc = None
    text = stdout + stderr
    for fault in sorted((out / "logs").rglob("fault.txt")):
        if fault.stat().st_size:
            text += f"\n--- {fault.relative_to(out)}\n" + fault.read_text(errors="replace")
    if rc is None:
        kind = "hang"
    elif rc == 0 and not any(mark in text for mark in ABORT_MARKS):
        kind = "ok"
    elif any(mark in text for mark in ABORT_MARKS):
        kind = "abort"
    else:
        kind = "error"
    return {"run": index, "kind": kind, "rc": rc, "seconds": round(time.monotonic() - start, 2), "output": text}


def stress(runs: int, parallel: int = 2, save: bool = False, timeout: float = 120, keep: str | None = None) -> dict:
    """Run the job ``runs`` times, ``parallel`` at once; the summary counts each way a run ended."""
    root = Path(tempfile.mkdtemp(prefix="hasten-exit-stress-"))
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(lambda i: one_run(i, root, save, timeout), range(runs)))
    finally:
        if keep:
            shutil.copytree(root, keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    counts = {kind: sum(r["kind"] == kind for r in results) for kind in ("ok", "abort", "error", "hang")}
    return {
        "runs": runs,
        "parallel": parallel,
        "save": save,
        **counts,
        "seconds": round(time.monotonic() - start, 1),
        "failures": [r for r in results if r["kind"] != "ok"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--save", action="store_true", help="save_state before exiting")
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a launch counts as hung")
    parser.add_argument("--keep", default=None, help="copy every run's logs here")
    args = parser.parse_args()
    summary = stress(args.runs, args.parallel, args.save, args.timeout, args.keep)
    for failure in summary["failures"]:
        print(
            f"run {failure['run']}: {failure['kind']} (rc {failure['rc']})\n{failure['output'][-3000:]}\n",
            file=sys.stderr,
        )
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    sys.exit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
