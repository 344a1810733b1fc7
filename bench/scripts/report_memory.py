"""``hasten profile-report`` on a big generated trace: peak memory (RSS) and wall time.

Not a row of bench/run.py: run it by hand, ``python bench/scripts/report_memory.py --mb 189``.
It writes one rank's trace of about ``--mb`` megabytes, shaped like torch's own export
(indented JSON, metadata rows, ProfilerStep ranges, hasten's labels, nested aten operators
with their args, flow events), then runs ``python -m hasten.report`` on it in a child
process and prints the child's peak resident memory (``getrusage``'s ``ru_maxrss``) and
its wall time. Nothing is asserted: the numbers are for people to read (docs: issue 16,
item 10, aims at 200 MB or less for a 189 MB trace).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPS = ("aten::linear", "aten::addmm", "aten::relu", "aten::copy_", "aten::empty", "aten::mul", "aten::sum")


def write_trace(path: Path, megabytes: float, rank: int = 0) -> int:
    """A torch-like Chrome trace of about ``megabytes`` MB; returns its event count."""
    target = int(megabytes * 1e6)
    pid, tid = 4000 + rank, 4000 + rank
    events = 0
    ts = 5_435_500_000_000.0

    def dump(event: dict) -> str:
        return json.dumps(event, indent=2)  # torch writes one key per line, as here

    with open(path, "w", encoding="utf-8") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n')
        f.write(f'  "distributedInfo": {{"backend": "gloo", "rank": {rank}, "world_size": 1}},\n')
        f.write('  "trace_id": "0123456789ABCDEF", "displayTimeUnit": "ms",\n')
        f.write('  "baseTimeNanoseconds": 1790857026000000000,\n  "traceEvents": [\n')
        meta = [
            {"ph": "M", "name": "process_name", "ts": ts, "pid": pid, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "ts": ts, "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
            {"ph": "M", "name": "thread_name", "ts": ts, "pid": pid, "tid": tid, "args": {"name": "main"}},
        ]
        f.write(",\n".join(dump(e) for e in meta))
        events += len(meta)
        step = 0
        while f.tell() < target:
            step += 1
            start = ts
            chunk = []
            for label, dur in (
                ("hasten.data_wait", 40.0),
                ("hasten.forward", 400.0),
                ("hasten.backward", 800.0),
                ("hasten.optimizer_step", 200.0),
            ):
                chunk.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": label,
                        "pid": pid,
                        "tid": tid,
                        "ts": ts,
                        "dur": dur,
                        "args": {"External id": events, "Record function id": 0, "Ev Idx": events},
                    }
                )
                inner = ts + 1.0
                for i in range(int(dur // 12)):
                    op = OPS[i % len(OPS)]
                    chunk.append(
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": op,
                            "pid": pid,
                            "tid": tid,
                            "ts": inner,
                            "dur": 10.0,
                            "args": {
                                "External id": events + i,
                                "Record function id": 0,
                                "Sequence number": i,
                                "Fwd thread id": 0,
                                "Ev Idx": events + i,
                            },
                        }
                    )
                    chunk.append(
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": "aten::empty_strided",
                            "pid": pid,
                            "tid": tid,
                            "ts": inner + 1.0,
                            "dur": 3.5,
                            "args": {"External id": events + i, "Ev Idx": events + i},
                        }
                    )
                    inner += 12.0
                ts += dur + 5.0
            chunk.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{step}",
                    "pid": pid,
                    "tid": tid,
                    "ts": start,
                    "dur": ts - start,
                    "args": {"External id": events, "Ev Idx": events},
                }
            )
            chunk.append({"ph": "s", "id": step, "pid": pid, "tid": tid, "ts": start, "cat": "ac2g", "name": "flow"})
            chunk.append(
                {
                    "ph": "f",
                    "id": step,
                    "pid": pid,
                    "tid": tid,
                    "ts": start + 1,
                    "cat": "ac2g",
                    "name": "flow",
                    "bp": "e",
                }
            )
            f.write(",\n" + ",\n".join(dump(e) for e in chunk))
            events += len(chunk)
        f.write('\n  ],\n  "traceName": "trace_rank0.json"\n}\n')
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=189.0, help="size of the generated trace in MB (default 189)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="write the trace here and keep it")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hasten-report-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "trace_rank0.json"
    t0 = time.perf_counter()
    count = write_trace(trace, args.mb)
    print(f"trace: {trace.stat().st_size / 1e6:.1f} MB, {count} events, written in {time.perf_counter() - t0:.1f} s")
    merged = folder / "merged.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hasten.report",
            str(folder),
            "--no-png",
            "--merged",
            str(merged),
            "--max-trace-mb",
            "100000",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    if proc.returncode == 2 and "--max-trace-mb" in proc.stderr:  # a report without the flag (before it existed)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "hasten.report", str(folder), "--no-png", "--merged", str(merged)],
            capture_output=True,
            text=True,
            env=env,
        )
        wall = time.perf_counter() - t0
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(proc.stdout[-1500:] if proc.returncode == 0 else proc.stderr[-3000:])
    print(
        f"profile-report: exit {proc.returncode}, wall {wall:.1f} s, peak RSS {peak_mb:.0f} MB"
        + (" (first run's peak: the parent's children so far)" if before else "")
    )
    print(f"merged trace: {merged.stat().st_size / 1e6:.1f} MB" if merged.exists() else "no merged trace")
    if not args.keep:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
