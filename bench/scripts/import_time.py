"""Row 2: the wall time of ``python -c "<import>"`` ÷ ``python -c "import torch"``.

``import hasten`` is lazy (it loads no torch), so it is measured, and so is
``from hasten import Accelerator``, which loads what a training script needs: that is the
honest figure. Accelerate's and Fabric's documented imports run alongside when installed.
All commands run interleaved, one after another, round after round.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import subprocess
import sys

from _harness import emit, interleave, ratio_summary

COMMANDS = {
    "torch": "import torch",
    "hasten": "import hasten",
    "hasten_accelerator": "from hasten import Accelerator",
    "accelerate": "from accelerate import Accelerator",
    "fabric": "from lightning.fabric import Fabric",
}
NEEDS = {"accelerate": "accelerate", "fabric": "lightning"}


def runner(code: str, cpu: list[float]):
    """Runs the import; also keeps the child's CPU time (user + system), less noisy than wall time."""

    def run(stamps: list[float]) -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Fabric out")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = [
        n for n in COMMANDS if n not in NEEDS or (not args.no_others and importlib.util.find_spec(NEEDS[n]) is not None)
    ]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    times = interleave({n: runner(COMMANDS[n], cpu[n]) for n in names}, args.rounds)
    cpu = {n: c[-args.rounds :] for n, c in cpu.items()}  # the warm-up runs are not counted
    result = {
        "row": "import_time",
        "commands": {n: COMMANDS[n] for n in names},
        "torch_s": sorted(times["torch"])[len(times["torch"]) // 2],
    }
    for n in names:
        if n != "torch":
            result[n] = ratio_summary(times, "torch", n)
            result[n]["cpu"] = ratio_summary(cpu, "torch", n)
    emit(result, args.out)


if __name__ == "__main__":
    main()
