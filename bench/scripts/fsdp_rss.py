"""Row 9: peak RSS per rank, hasten FSDP2 ÷ hasten DDP, for row 8's ~50M-parameter model with
AdamW: two launches of ``fsdp_memory.py --variant fsdp|ddp`` (2 gloo processes each, under
``torch.distributed.run``), alternated over rounds; each reports the larger of its ranks' peaks."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _harness import child_env, emit, summary  # noqa: E402


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak(variant: str, width: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port()), os.path.join(os.path.dirname(__file__), "fsdp_memory.py"),
               "--variant", variant, "--width", str(width), "--out", out]
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:  # say why: the run's own error, not only its exit status
            raise RuntimeError(f"{variant} run failed with exit status {proc.returncode}:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"fsdp": [], "ddp": []}
    for r in range(args.rounds):
        for variant in ("fsdp", "ddp") if r % 2 == 0 else ("ddp", "fsdp"):
            runs[variant].append(peak(variant, args.width))
    ratios = [f["peak_rss_mb"] / d["peak_rss_mb"] for f, d in zip(runs["fsdp"], runs["ddp"])]
    emit({
        "peak_rss_mb": {k: summary([r["peak_rss_mb"] for r in v])["median"] for k, v in runs.items()},
        "bytes": {k: v[0]["bytes"] for k, v in runs.items()},
        "rss_ratio": summary(ratios),
    }, args.out)


if __name__ == "__main__":
    main()
