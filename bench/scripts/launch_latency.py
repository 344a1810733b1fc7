"""Row 5: the wall time of ``hasten launch --num_processes 2 noop.py`` ÷
``torchrun --nproc_per_node 2 noop.py``, from the command to its exit.

The launchers are the console scripts installed next to this Python, run as a user types
them. torchrun and hasten get no port (each then finds a free one); Accelerate and Fabric
would default to a fixed port, so they get a free one on the command line (the machine is
shared). Accelerate and Fabric, when installed,
launch the same script alongside: ``accelerate launch --multi_gpu`` (its ``--cpu`` launches a
single process; ``--multi_gpu`` is what starts 2 processes through torchrun on a machine
without GPUs) and ``fabric run --accelerator cpu --devices 2``. Interleaved, round after round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys

from _harness import child_env, emit, interleave, ratio_summary

NOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "noop.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str | None:
    """The console script ``name`` installed beside this Python, if any."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name)


def commands(others: bool) -> dict:
    found = {
        # As typed, no port: on one machine torch then rendezvous through a c10d store on a free
        # port, as hasten launch does without --main_process_port (a given port means the static
        # rendezvous, which starts ~0.3 s sooner here but needs the port to be free).
        "torchrun": lambda: [tool("torchrun"), "--nproc_per_node", "2", NOOP],
        "hasten": lambda: [tool("hasten"), "launch", "--num_processes", "2", NOOP],
    }
    if others and tool("accelerate"):
        found["accelerate"] = lambda: [
            tool("accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            NOOP,
        ]
    if others and tool("fabric"):
        found["fabric"] = lambda: [
            tool("fabric"),
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--main-port",
            str(free_port()),
            NOOP,
        ]
    return found


def runner(make_cmd):
    def run() -> None:
        subprocess.run(
            make_cmd(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300, env=child_env()
        )

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8, help="rounds of torchrun and hasten launch")
    parser.add_argument("--rounds-others", type=int, default=3, help="rounds of torchrun, Accelerate and Fabric")
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Fabric out")
    parser.add_argument("--out")
    args = parser.parse_args()
    cmds = commands(not args.no_others)
    # one clean environment for all launchers: no launcher variables from a surrounding run
    for key in [
        k
        for k in os.environ
        if k.startswith(("HASTEN_", "ACCELERATE_"))
        or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    ]:
        del os.environ[key]
    # Two interleaved groups, each against its own torchrun runs: hasten gets more rounds than
    # the slow launchers (Fabric's takes ~10 s) could afford in the same time.
    times = interleave({n: runner(cmds[n]) for n in ("torchrun", "hasten")}, args.rounds)
    result = {
        "row": "launch_latency",
        "commands": {
            n: " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(c())) for n, c in cmds.items()
        },
        "torchrun_s": sorted(times["torchrun"])[len(times["torchrun"]) // 2],
        "hasten": ratio_summary(times, "torchrun", "hasten"),
    }
    others = [n for n in cmds if n not in ("torchrun", "hasten")]
    if others:
        times = interleave({n: runner(cmds[n]) for n in ("torchrun", *others)}, args.rounds_others)
        for n in others:
            result[n] = ratio_summary(times, "torchrun", n)
    emit(result, args.out)


if __name__ == "__main__":
    main()
