"""``hasten lighthouse --min_replicas N --port P``: torchft's lighthouse, once per fault-tolerant job.

The lighthouse (torchft's ``LighthouseServer``) keeps the replica groups of a job in a quorum;
each group's ``hasten launch --ft_lighthouse http://HOST:P`` (``FaultToleranceKwargs``) reaches it.
It runs in the foreground until stopped (Ctrl-C or SIGTERM). torchft is imported only when it
starts, so ``hasten lighthouse --help`` does not need it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from hasten import _validate as v

DESCRIPTION = (
    "Start torchft's lighthouse (LighthouseServer), which keeps the replica groups of a fault-tolerant job "
    "(FaultToleranceKwargs) in a quorum. Start it once per job, then one `hasten launch --ft_replica_group G "
    "--ft_num_replica_groups K --ft_lighthouse http://HOST:PORT train.py` per replica group. Runs until stopped."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hasten lighthouse", description=DESCRIPTION)
    parser.add_argument(
        "--min_replicas",
        type=v.positive_int_argument("--min_replicas"),
        default=1,
        help="the fewest replica groups a quorum needs (default: 1)",
    )
    parser.add_argument("--port", type=int, default=29510, help="the port to listen on (default: 29510; 0: any free)")
    parser.add_argument("--bind", default="[::]", help="the address to listen on (default: [::], every interface)")
    parser.add_argument(
        "--join_timeout_ms",
        type=v.positive_int_argument("--join_timeout_ms"),
        default=None,
        help="how long a new quorum waits for more groups to join once min_replicas have (torchft's default)",
    )
    parser.add_argument(
        "--heartbeat_timeout_ms",
        type=v.positive_int_argument("--heartbeat_timeout_ms"),
        default=None,
        help="how long without a heartbeat before a group counts as dead (torchft's default)",
    )
    return parser


def lighthouse_command(argv: Sequence[str], stop: threading.Event | None = None) -> int:
    """Run the lighthouse until SIGINT/SIGTERM (or until ``stop`` is set, for tests)."""
    args = _parser().parse_args(list(argv))
    if not 0 <= args.port <= 65535:
        print(f"hasten lighthouse: --port must be 0 .. 65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        print(f"hasten lighthouse needs torchft: pip install 'hasten[ft]' ({e})", file=sys.stderr)
        return 1
    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except RuntimeError as e:
        print(f"hasten lighthouse: cannot listen on {args.bind}:{args.port}: {e}", file=sys.stderr)
        return 1
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        if threading.current_thread() is threading.main_thread():
            signal.signal(sig, lambda *_: stop.set())
    print(f"hasten lighthouse: {server.address()} (min_replicas={args.min_replicas})", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
    return 0
