"""Timing helpers shared by the benchmark scripts.

Every figure is a ratio taken in one run: the variants run interleaved, round after round
(commands in an order reversed every other round, A B C / C B A; training loops in a
shuffled order), and a variant's ratio in a round is its figure over the baseline's figure
in that same round. The reported figure is the median of those
per-round ratios, with the quartiles as the spread.

A command's figure is its time; a training loop's is the median step time of a short block
of steps: on a shared machine a block is often interrupted, and the median step shrugs that
off where the block total does not. Nothing is asserted here: the numbers are for people
to read.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator

RESULT_MARK = "BENCH_RESULT "


def interleave(variants: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each variant once per round, interleaved; its wall time (seconds) per round.

    For whole commands (a subprocess each); the untimed warm-up round fills the caches.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    figures: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            variants[name]()
            figures[name].append(time.perf_counter() - start)
    return figures


def interleave_steps(
    loops: dict[str, Callable[[], Iterator[object]]],
    rounds: int,
    steps: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Interleave training loops in short blocks; the median step time of each block.

    Each loop is a function returning an iterator that runs one training step per ``next()``
    (an epoch; it is restarted when exhausted). In a round, every loop runs ``steps``
    consecutive steps in turn, so the blocks compared sit milliseconds apart and see the
    same machine. A loop runs slower after a heavier one (its caches were evicted: several
    percent when loops alternate step by step, and still a percent or two for the first
    steps of a block), so the first step of each block is not counted, and the order of
    the loops is shuffled every round (seeded): each loop follows each other one equally
    often, instead of always the same neighbour.
    """
    names = list(loops)
    iters = {name: loops[name]() for name in names}

    def one_step(name: str) -> float:
        start = clock()
        if next(iters[name], _END) is _END:  # end of epoch: start the next one, time a real step
            iters[name] = loops[name]()
            start = clock()
            next(iters[name])
        return clock() - start

    for _ in range(warmup):
        for name in names:
            one_step(name)
    gc.collect()
    gc.freeze()
    figures: dict[str, list[float]] = {name: [] for name in names}
    shuffle = random.Random(0)
    for _ in range(rounds):
        taken: dict[str, list[float]] = {name: [] for name in names}
        gc.collect(1)
        gc.disable()
        try:
            for name in shuffle.sample(names, len(names)):
                one_step(name)  # the switch step
                for _ in range(steps):
                    taken[name].append(one_step(name))
        finally:
            gc.enable()
        for name in names:
            figures[name].append(statistics.median(taken[name]))
    return figures


_END = object()


def summary(values: list[float]) -> dict[str, float]:
    """Median and quartiles of a list of per-round figures."""
    ordered = sorted(values)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1, q3 = ordered[0], ordered[-1]
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "n": len(ordered)}


def ratio_summary(times: dict[str, list[float]], base: str, name: str) -> dict[str, float]:
    """Per-round ``name / base`` ratios, summarised."""
    return summary([t / b for t, b in zip(times[name], times[base])])


def emit(result: dict, path: str | None = None) -> None:
    """Hand a result to the driver: a JSON file when ``path`` is given, else a marked stdout line."""
    text = json.dumps(result)
    if path:
        with open(path, "w", encoding="utf-8") as fp:
            fp.write(text)
    else:
        sys.stdout.write(RESULT_MARK + text + "\n")
        sys.stdout.flush()


def child_env() -> dict[str, str]:
    """The environment for a timed command: this one, but writing bytecode as Python does by
    default (a machine-wide PYTHONDONTWRITEBYTECODE=1 would make every start recompile hasten,
    an editable install, while torch's installed bytecode is read: not what a user sees).
    The untimed warm-up run writes the ``__pycache__`` files."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def single_thread() -> None:
    """One intra-op thread: the tiny models here gain nothing from more, and it cuts the noise."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
