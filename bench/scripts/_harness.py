"""Timing helpers shared by the benchmark scripts.

Every figure is a ratio taken in one run: the variants run in interleaved blocks (the order
reversed every other round, A B C / C B A ...), and a variant's ratio in a round is its
block figure over the baseline's block figure in that same round. The reported figure is the
median of those per-round ratios, with the quartiles as the spread.

A block figure is the block's wall-clock time, or, for a training loop that stamps the
clock after each step, the median step time of the block: on a shared machine a block is
often interrupted, and the median step shrugs that off where the block total does not.
Nothing is asserted here: the numbers are for people to read.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

RESULT_MARK = "BENCH_RESULT "


def interleave(
    variants: dict[str, Callable[[list[float]], object]],
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Run one block of each variant per round, interleaved; one figure (seconds) per block.

    Each variant is called with a list: a loop appends ``clock()`` after every step (the
    list already holds the start), and its figure is the median step time; a variant that
    appends nothing is timed as a whole block. ``clock`` is wall time by default;
    single-threaded loops pass ``time.thread_time`` (CPU time of the thread), which does
    not count the time another process held the core.
    """
    names = list(variants)
    # Everything built so far (modules, models) moves out of the collector's sight, so the
    # small collection between blocks is cheap; none runs inside a block.
    gc.collect()
    gc.freeze()
    for _ in range(warmup):
        for name in names:
            variants[name]([clock()])
    figures: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            gc.collect(1)
            gc.disable()
            try:
                stamps = [clock()]
                variants[name](stamps)
                end = clock()
            finally:
                gc.enable()
            if len(stamps) > 2:
                figures[name].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
            else:
                figures[name].append(end - stamps[0])
    return figures


def interleave_steps(
    loops: dict[str, Callable[[], Iterator[object]]],
    rounds: int,
    steps: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Interleave training loops step by step; the median step time of each loop per round.

    Each loop is a function returning an iterator that runs one training step per ``next()``
    (an epoch; it is restarted when exhausted). In a round, every loop runs one step in
    turn (A B C, then C B A for the next step), ``steps`` times; so the steps compared sit
    a few hundred microseconds apart and see the same machine.
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
    for _ in range(rounds):
        taken: dict[str, list[float]] = {name: [] for name in names}
        gc.collect(1)
        gc.disable()
        try:
            for s in range(steps):
                for name in names if s % 2 == 0 else names[::-1]:
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


def single_thread() -> None:
    """One intra-op thread: the tiny models here gain nothing from more, and it cuts the noise."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
