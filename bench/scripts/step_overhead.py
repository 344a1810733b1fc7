"""Row 1: per-step time of a prepared training loop ÷ the same raw PyTorch loop (CPU, tiny MLP).

For each precision (fp32, bf16, fp16) the raw loop, hasten's, and (when installed)
Accelerate's and Lightning Fabric's run interleaved in blocks of a few steps. The raw loops are
what hasten does, written by hand: bf16/fp16 put ``torch.autocast`` around the forward and
cast the output to float32; fp16 adds ``torch.amp.GradScaler("cpu")``.
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _harness import emit, interleave_steps, ratio_summary, single_thread
from torch.utils.data import DataLoader, TensorDataset

BATCH = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def make_loader(samples: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def raw_loop(precision: str, samples: int):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = make_loader(samples)
    dtype = DTYPES.get(precision)
    if dtype is None:

        def epoch() -> Iterator[None]:
            for x, y in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                yield

    elif precision == "bf16":

        def epoch() -> Iterator[None]:
            for x, y in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                loss.backward()
                opt.step()
                yield

    else:
        scaler = torch.amp.GradScaler("cpu")

        def epoch() -> Iterator[None]:
            for x, y in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                yield

    return epoch


def library_epoch(acc, model, opt, loader) -> Iterator[None]:
    """The user's loop as written for hasten and Accelerate alike (the same API): one yield a step."""
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        yield


def hasten_loop(precision: str, samples: int):
    from hasten import Accelerator

    acc = Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=True)
    model = make_model()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loader(samples))

    def epoch() -> Iterator[None]:
        yield from library_epoch(acc, model, opt, loader)

    return epoch


def accelerate_loop(precision: str, samples: int):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one mixed precision per process otherwise
    acc = Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=True)
    model = make_model()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loader(samples))
    # What Accelerate really runs: on CPU it keeps fp16 off (no autocast, no scaler), without a word.
    runs = "fp32" if acc.mixed_precision == "no" or not acc.native_amp else acc.mixed_precision

    def epoch() -> Iterator[None]:
        yield from library_epoch(acc, model, opt, loader)

    return epoch, runs


def fabric_loop(precision: str, samples: int):
    from lightning.fabric import Fabric

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric = Fabric(
            accelerator="cpu",
            devices=1,
            precision={"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[precision],
        )
    model = make_model()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(make_loader(samples))
    plugin = fabric._precision
    runs = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(getattr(plugin, "precision", ""), "fp32")
    warned = any("not supported on CPU" in str(w.message) for w in caught)

    def epoch() -> Iterator[None]:
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
            yield

    return epoch, runs, warned


def scale_reads_per_step(samples: int, steps: int = 8) -> float:
    """``GradScaler.get_scale()`` calls per fp16 optimizer step in hasten's loop: each is a device
    sync on a GPU (on top of the one ``GradScaler.step`` makes); the hand-written loop makes none."""
    calls = [0]
    real = torch.amp.GradScaler.get_scale

    def counting(self):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(self)

    torch.amp.GradScaler.get_scale = counting  # type: ignore[method-assign]
    try:
        loop = hasten_loop("fp16", samples)
        epoch = loop()
        for _ in range(steps):
            try:
                next(epoch)
            except StopIteration:
                epoch = loop()
                next(epoch)
    finally:
        torch.amp.GradScaler.get_scale = real  # type: ignore[method-assign]
    return calls[0] / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=16, help="steps of each loop per round")
    parser.add_argument("--samples", type=int, default=1024, help="samples per epoch")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--no-others", action="store_true", help="leave Accelerate and Fabric out")
    parser.add_argument("--out")
    args = parser.parse_args()
    single_thread()
    warnings.filterwarnings("ignore")
    others = not args.no_others
    have_accelerate = others and importlib.util.find_spec("accelerate") is not None
    have_fabric = others and importlib.util.find_spec("lightning") is not None

    result: dict = {
        "row": "step_overhead",
        "batch": BATCH,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "precisions": {},
    }
    for precision in args.precisions.split(","):
        variants = {
            "raw": raw_loop(precision, args.samples),
            # A/A control: a second, identical raw loop; its ratio shows the bias and noise floor.
            "raw_again": raw_loop(precision, args.samples),
            "hasten": hasten_loop(precision, args.samples),
        }
        notes: dict = {}
        if have_accelerate:
            variants["accelerate"], notes["accelerate_runs"] = accelerate_loop(precision, args.samples)
        if have_fabric:
            variants["fabric"], notes["fabric_runs"], notes["fabric_warned"] = fabric_loop(precision, args.samples)
        times = interleave_steps(variants, args.rounds, args.steps)
        entry = {
            "raw_step_us": 1e6 * sorted(times["raw"])[len(times["raw"]) // 2],
            **notes,
        }
        for name in variants:
            if name != "raw":
                entry[name] = ratio_summary(times, "raw", name)
        if precision == "fp16":
            entry["scale_reads_per_step"] = scale_reads_per_step(args.samples)
        result["precisions"][precision] = entry
    emit(result, args.out)


if __name__ == "__main__":
    main()
