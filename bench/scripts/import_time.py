"""Row 2: the time of ``python -c "<import>"`` ÷ ``python -c "import torch"``.

``import hasten`` is lazy (it loads no torch), so it is measured, and so is
``from hasten import Accelerator``, which loads what a training script needs: that is the
honest figure. Accelerate's and Fabric's documented imports run alongside when installed.
All commands run interleaved, one after another, round after round.

Two clocks: the child's CPU time (user + system, from ``getrusage``) and wall time. On a
shared machine the wall time of a 2-4 s import swings by tens of percent from one run to
the next with other processes' load, the CPU time far less, so CPU time is the headline
and wall time is reported beside it. The library commands also time themselves inside the
process: ``import torch`` first, then the library, so the library's own share (what it
imports on top of torch) is measured without the noise of torch's import.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys

from _harness import child_env, emit, interleave, ratio_summary

SPLIT = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); {}; "
    "print('SPLIT', time.perf_counter() - t1, t1 - t0)"
)
IMPORTS = {
    "torch": "import torch",
    "hasten": "import hasten",
    "hasten_accelerator": "from hasten import Accelerator",
    "accelerate": "from accelerate import Accelerator",
    "fabric": "from lightning.fabric import Fabric",
}
SPLIT_TIMED = ("hasten_accelerator", "accelerate", "fabric")
NEEDS = {"accelerate": "accelerate", "fabric": "lightning"}
ENV = child_env()


def runner(name: str, cpu: list[float], split: list[float]):
    code = SPLIT.format(IMPORTS[name]) if name in SPLIT_TIMED else IMPORTS[name]

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run([sys.executable, "-c", code], check=True, env=ENV, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        for line in proc.stdout.splitlines():
            if line.startswith("SPLIT "):
                own, torch_s = map(float, line.split()[1:])
                split.append(own / torch_s)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8, help="rounds of torch and hasten")
    parser.add_argument("--rounds-others", type=int, default=3, help="rounds of torch, Accelerate and Fabric")
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Fabric out")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = [
        n for n in IMPORTS if n not in NEEDS or (not args.no_others and importlib.util.find_spec(NEEDS[n]) is not None)
    ]
    result: dict = {"row": "import_time", "commands": {n: IMPORTS[n] for n in names}}
    # Two interleaved groups, each against its own `import torch` runs: hasten gets more
    # rounds than Fabric's ~10 s import could afford in the same time.
    mine = [n for n in names if n not in NEEDS]
    for group, rounds in ((mine, args.rounds), (["torch", *[n for n in names if n in NEEDS]], args.rounds_others)):
        if len(group) < 2:
            continue
        cpu: dict[str, list[float]] = {n: [] for n in group}
        split: dict[str, list[float]] = {n: [] for n in group}
        wall = interleave({n: runner(n, cpu[n], split[n]) for n in group}, rounds)
        cpu = {n: c[-rounds:] for n, c in cpu.items()}  # the warm-up run is not counted
        if "torch_s" not in result:
            result["torch_s"] = statistics.median(wall["torch"])
            result["torch_cpu_s"] = statistics.median(cpu["torch"])
        for n in group[1:]:
            result[n] = ratio_summary(cpu, "torch", n)
            result[n]["wall"] = ratio_summary(wall, "torch", n)
            if split[n]:
                result[n]["own_share"] = statistics.median(split[n][-rounds:])
    emit(result, args.out)


if __name__ == "__main__":
    main()
