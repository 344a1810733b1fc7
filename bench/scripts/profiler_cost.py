"""Row 6: a training loop inside ``accelerator.profile()`` during the schedule's ``wait`` steps
÷ the same loop without a profiler (CPU, the tiny MLP of row 1, so any cost shows).

The profiled loop stays inside one ``profile()`` block for the whole run and calls
``prof.step()`` after each step, as a user would; the schedule's ``wait`` is longer than the
run, so the profiler never records. The loops run interleaved in blocks of a few steps, each on its own
Accelerator, with a second unprofiled loop as an A/A control, and the same loop inside a bare
``torch.profiler.profile`` with the same schedule, for comparison: torch's ``prof.step()``
closes and opens a ``ProfilerStep#N`` range on every step, recording or not, which hasten's
profiler skips while the schedule is idle.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _harness import emit, interleave_steps, ratio_summary, single_thread
from step_overhead import library_epoch, make_loader, make_model


def loop(profiled: str, samples: int, wait: int):
    from hasten import Accelerator, ProfileKwargs

    acc = Accelerator(cpu=True)
    model = make_model()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loader(samples))

    def epoch() -> Iterator[None]:
        yield from library_epoch(acc, model, opt, loader)

    if not profiled:
        return epoch, None
    handler = ProfileKwargs(activities=["cpu"], schedule_option={"wait": wait, "warmup": 0, "active": 1})

    def profiled_run() -> Iterator[None]:
        with acc.profile(handler) if profiled == "hasten" else handler.build() as prof:
            while True:
                for x, y in loader:
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    acc.backward(loss)
                    opt.step()
                    prof.step()
                    yield

    run = profiled_run()
    return (lambda: run), run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--no-others", action="store_true", help="accepted for the driver; this row is hasten's alone")
    parser.add_argument("--out")
    args = parser.parse_args()
    single_thread()
    warnings.filterwarnings("ignore")
    total = (args.rounds + 2) * args.steps + 10
    plain, _ = loop("", args.samples, total)
    again, _ = loop("", args.samples, total)
    profiled, run = loop("hasten", args.samples, total)
    bare, bare_run = loop("torch", args.samples, total)
    loops = {"plain": plain, "plain_again": again, "profiled": profiled, "torch_profiler": bare}
    times = interleave_steps(loops, args.rounds, args.steps)
    run.close()  # leaves the profile() block
    bare_run.close()
    emit(
        {
            "row": "profiler_cost",
            "wait_steps": total,
            "plain_step_us": 1e6 * sorted(times["plain"])[len(times["plain"]) // 2],
            "profiled": ratio_summary(times, "plain", "profiled"),
            "plain_again": ratio_summary(times, "plain", "plain_again"),
            "torch_profiler": ratio_summary(times, "plain", "torch_profiler"),
            "profiled_vs_torch_profiler": ratio_summary(times, "torch_profiler", "profiled"),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
