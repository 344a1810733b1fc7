"""Throughput: batches, samples, tokens and FLOPs per second, MFU and peak memory (``hasten.utils``).

Lightning Fabric's ``Throughput``, ``ThroughputMonitor``, ``measure_flops`` and
``get_available_flops``, with the same names, arguments and metric keys, built on the
Accelerator: ``ThroughputMonitor(accelerator)`` takes the world size, the device and its
precision from it, and ``compute_and_log`` sends the figures to every tracker of the
accelerator with one ``accelerator.log`` call::

    from hasten.utils import ThroughputMonitor, measure_flops

    monitor = ThroughputMonitor(accelerator, window_size=50)
    with torch.device("meta"):  # counting FLOPs on a meta copy allocates nothing
        meta_model, meta_x = MyModel(), torch.empty(batch_size, 128)
    monitor.flops_per_batch = measure_flops(meta_model, lambda: meta_model(meta_x), lambda y: y.sum())
    start = time.perf_counter()
    for i, (x, y) in enumerate(loader, 1):
        ...  # forward, backward, optimizer step
        monitor.update(time=time.perf_counter() - start, batches=i, samples=i * batch_size)
        if i % 50 == 0:
            monitor.compute_and_log(step=i)

What it costs: ``update`` checks its numbers and appends them to a fixed-size window; it
reads no tensor, never synchronises the device and runs no collective, so a loop pays
nothing for the steps where the figures are not read. ``compute`` does the arithmetic over
the window (and reads the allocator's peak), still without a collective: the world figures
are the device's times the world size, as in Fabric (every process is taken to do the same
work). Times given without a device synchronisation are right on average over a window.

Figures (``compute``; ``device/`` is ``f"device{separator}"``):

==============================  =============================================================
``time``, ``batches``,          the totals of the newest ``update`` (per process)
``samples``, ``lengths``
``device/batches_per_sec``      over the window (the newest ``window_size`` updates)
``device/samples_per_sec``
``device/items_per_sec``        tokens per second when ``lengths`` (or ``sequence_length``) is given
``device/flops_per_sec``        when ``flops`` (or ``flops_per_batch``) is given
``device/mfu``                  ``device/flops_per_sec`` over the device's peak FLOP/s, when known
``batches_per_sec``, ...        with several processes: the device figures times the world size
``device/peak_memory_gib``      (``ThroughputMonitor``) ``max_memory_allocated`` of the device;
                                on the CPU the process's peak resident set size
==============================  =============================================================

Differences from Fabric: the rates appear from the second ``update`` on, over the updates
the window holds so far (Fabric waits until the window is full); ``ThroughputMonitor``
computes on every process (Fabric only on rank 0) and logs through ``accelerator.log``, whose
main-process-only trackers write once; a refused ``update`` changes nothing.
"""

from __future__ import annotations

import collections
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hasten import _validate as v

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops", "peak_memory_bytes"]

_GIB = 1024**3


class _Point(NamedTuple):
    time: float
    batches: int
    samples: int
    lengths: int | None
    flops: float | None  # since the previous update


class Throughput:
    """Rolling throughput over the newest ``window_size`` updates (Fabric's ``Throughput``).

    Args:
        available_flops: peak FLOP/s of one device (for ``device/mfu``); None leaves MFU out.
        world_size: processes doing the same work; above 1 the world figures are added.
        window_size: updates the rates are computed over (at least 2).
        separator: between ``device`` and a figure's name in the keys.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        owner = type(self).__name__
        if available_flops is not None:
            v.check_number(owner, "available_flops", available_flops, gt=0)
        v.check_number(owner, "world_size", world_size, integer=True, ge=1)
        v.check_number(owner, "window_size", window_size, integer=True, ge=2)
        if not isinstance(separator, str):
            raise TypeError(f"{owner}.separator must be a str, got {v.shown(separator)} ({type(separator).__name__})")
        self.available_flops = available_flops
        self.world_size = world_size
        self.window_size = window_size
        self.separator = separator
        self._window: collections.deque[_Point] = collections.deque(maxlen=window_size)

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """Record the totals so far on this process (each larger than at the previous update).

        Args:
            time: seconds elapsed (any clock that only increases, e.g. ``time.perf_counter()``).
            batches: batches processed so far by this process.
            samples: samples processed so far by this process (at least ``batches``).
            lengths: items (tokens) processed so far (at least ``samples``), for ``items_per_sec``.
            flops: FLOPs this process did since the previous update (``measure_flops`` times
                the batches since then), for ``flops_per_sec`` and ``mfu``.
        """
        self._window.append(self._checked(time, batches, samples, lengths, flops))

    def _checked(self, time: Any, batches: Any, samples: Any, lengths: Any, flops: Any) -> _Point:
        owner = f"{type(self).__name__}.update"
        v.check_number(owner, "time", time)
        v.check_number(owner, "batches", batches, integer=True, ge=1)
        v.check_number(owner, "samples", samples, integer=True, ge=batches)
        if lengths is not None:
            v.check_number(owner, "lengths", lengths, integer=True, ge=samples)
        if flops is not None:
            v.check_number(owner, "flops", flops, ge=0)
        if self._window:
            last = self._window[-1]
            for field, value, before in (
                ("time", time, last.time),
                ("batches", batches, last.batches),
                ("samples", samples, last.samples),
                ("lengths", lengths, last.lengths),
            ):
                if value is not None and before is not None and not value > before:
                    raise ValueError(
                        f"{owner}: {field} must increase at each update (totals so far), got {v.shown(value)} "
                        f"after {v.shown(before)}; call reset() to start counting again"
                    )
        return _Point(time, batches, samples, lengths, flops)

    def compute(self) -> dict[str, int | float]:
        """The figures over the window (see the module's table)."""
        if not self._window:
            raise RuntimeError(
                f"{type(self).__name__}.compute: no update() yet; call update(time=..., batches=..., samples=...) "
                "after each batch first"
            )
        window = list(self._window)
        last = window[-1]
        metrics: dict[str, int | float] = {"time": last.time, "batches": last.batches, "samples": last.samples}
        if last.lengths is not None:
            metrics["lengths"] = last.lengths
        rates = _rates(window)
        device = f"device{self.separator}"
        for name, rate in rates.items():
            metrics[device + name] = rate
        if self.world_size > 1:
            for name, rate in rates.items():
                metrics[name] = rate * self.world_size
        if "flops_per_sec" in rates and self.available_flops:
            metrics[device + "mfu"] = rates["flops_per_sec"] / self.available_flops
        return metrics

    def reset(self) -> None:
        """Forget every update (e.g. at the start of an epoch, after evaluation)."""
        self._window.clear()


def _rates(window: list[_Point]) -> dict[str, float]:
    """Per-second rates over the window: batches and samples between its first and last points;
    items over the newest run of points that have ``lengths``; FLOPs over the newest run of
    points that have ``flops`` (a point's FLOPs were done since the point before it)."""
    if len(window) < 2:
        return {}
    first, last = window[0], window[-1]
    elapsed = last.time - first.time
    rates = {
        "batches_per_sec": (last.batches - first.batches) / elapsed,
        "samples_per_sec": (last.samples - first.samples) / elapsed,
    }
    start = _newest_run(window, "lengths")
    if start < len(window) - 1:
        anchor = window[start]
        rates["items_per_sec"] = (last.lengths - anchor.lengths) / (last.time - anchor.time)  # type: ignore[operator]
    start = max(_newest_run(window, "flops") - 1, 0)
    if start < len(window) - 1:
        done = sum(p.flops for p in window[start + 1 :])  # type: ignore[misc]
        rates["flops_per_sec"] = done / (last.time - window[start].time)
    return rates


def _newest_run(window: list[_Point], field: str) -> int:
    """The index where the newest run of points with ``field`` set begins (len(window) if none)."""
    start = len(window)
    while start > 0 and getattr(window[start - 1], field) is not None:
        start -= 1
    return start


_PRECISION_DTYPES: dict[str, torch.dtype] = {
    "no": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}


class ThroughputMonitor(Throughput):
    """``Throughput`` for an Accelerator's loop: world size, device, precision and trackers from it.

    Args:
        accelerator: the ``Accelerator`` (its ``num_processes``, ``device``, ``mixed_precision``, ``log``).
        window_size: updates the rates are computed over (at least 2).
        separator: between ``device`` and a figure's name in the keys.
        available_flops: peak FLOP/s of one device; by default the table's figure for the
            accelerator's CUDA device in its precision (``get_available_flops``), None on the CPU.
        flops_per_batch: FLOPs of one batch (``measure_flops``); ``update`` then derives ``flops``
            from the batches since the previous update. May also be set later, as an attribute.
        sequence_length: tokens per sample; ``update`` then derives ``lengths`` as samples times it.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        window_size: int = 100,
        separator: str = "/",
        available_flops: float | None = None,
        flops_per_batch: float | None = None,
        sequence_length: int | None = None,
    ) -> None:
        missing = [
            name for name in ("log", "device", "num_processes", "mixed_precision") if not hasattr(accelerator, name)
        ]
        if missing:
            raise TypeError(
                f"ThroughputMonitor: accelerator must be a hasten Accelerator, got {v.shown(accelerator)} "
                f"({type(accelerator).__name__}, without {', '.join(missing)})"
            )
        self.sequence_length = sequence_length
        self.device = torch.device(accelerator.device)
        if available_flops is None:
            dtype = _PRECISION_DTYPES.get(str(accelerator.mixed_precision), torch.float32)
            available_flops = get_available_flops(self.device, dtype)
        super().__init__(available_flops, accelerator.num_processes, window_size, separator)
        self.flops_per_batch = flops_per_batch
        self.step = -1
        self._accelerator = accelerator

    @property
    def flops_per_batch(self) -> float | None:
        """FLOPs of one batch on this process (forward and backward), or None."""
        return self._flops_per_batch

    @flops_per_batch.setter
    def flops_per_batch(self, value: float | None) -> None:
        if value is not None:
            v.check_number("ThroughputMonitor", "flops_per_batch", value, ge=0)
        self._flops_per_batch = value

    @property
    def sequence_length(self) -> int | None:
        """Tokens per sample, or None."""
        return self._sequence_length

    @sequence_length.setter
    def sequence_length(self, value: int | None) -> None:
        if value is not None:
            v.check_number("ThroughputMonitor", "sequence_length", value, integer=True, ge=1)
        self._sequence_length = value

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """As ``Throughput.update``; ``lengths`` and ``flops`` default to what ``sequence_length``
        and ``flops_per_batch`` give."""
        if lengths is None and self._sequence_length is not None and isinstance(samples, int):
            lengths = samples * self._sequence_length
        if flops is None and self._flops_per_batch is not None and isinstance(batches, int):
            before = self._window[-1].batches if self._window else 0
            flops = self._flops_per_batch * max(batches - before, 0)
        self._window.append(self._checked(time, batches, samples, lengths, flops))

    def compute(self) -> dict[str, int | float]:
        """``Throughput.compute``, with ``device/peak_memory_gib`` where the device says it."""
        metrics = super().compute()
        peak = peak_memory_bytes(self.device)
        if peak is not None:
            metrics[f"device{self.separator}peak_memory_gib"] = peak / _GIB
        return metrics

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> dict[str, int | float]:
        """``compute()``, logged to every tracker of the accelerator at ``step`` (by default one
        more than the last logged step, starting at 0); returns the figures. ``kwargs`` go to
        ``accelerator.log`` (``log_kwargs={"wandb": {...}}``), as Fabric's go to ``log_dict``."""
        if step is not None:
            v.check_number("ThroughputMonitor.compute_and_log", "step", step, integer=True, ge=0)
        metrics = self.compute()
        self.step = self.step + 1 if step is None else step
        self._accelerator.log(metrics, step=self.step, **kwargs)
        return metrics


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of ``forward_fn()`` (and of ``loss_fn(output).backward()`` when ``loss_fn`` is given),
    counted by ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and convolutions).

    A model on the meta device costs nothing to count. On a real model the call runs for real;
    the gradients it makes are dropped and the parameters' earlier ``.grad`` put back. Count on
    the plain model (``accelerator.unwrap_model(model)`` or a meta copy): a DDP or FSDP model's
    backward would start a collective the other processes do not join.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"measure_flops: model must be a torch.nn.Module, got {v.shown(model)} ({type(model).__name__})"
        )
    v.check_callable("measure_flops", "forward_fn", forward_fn, optional=False)
    v.check_callable("measure_flops", "loss_fn", loss_fn)
    from hasten.strategies.base import is_collective_wrapper

    wrapped = next((m for m in model.modules() if is_collective_wrapper(m)), None)
    if wrapped is not None:
        raise ValueError(
            f"measure_flops: model holds a {type(wrapped).__name__}, whose forward and backward run collectives "
            "the other processes would not join; count on a copy built on the meta device (for DDP, "
            "accelerator.unwrap_model(model) also works)"
        )
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            output = forward_fn()
            if loss_fn is not None:
                loss_fn(output).backward()
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad
    return counter.get_total_flops()


# Dense peak FLOP/s (no structured sparsity) of one GPU, from NVIDIA's datasheets; "tf32" is
# float32 matrix products on the tensor cores (torch.get_float32_matmul_precision() below "highest").
_T = 1e12
_CUDA_PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "b200": {"tf32": 1125 * _T, torch.bfloat16: 2250 * _T, torch.float16: 2250 * _T, torch.float8_e4m3fn: 4500 * _T},
    "h200": {torch.float32: 67 * _T, "tf32": 494.7 * _T, torch.bfloat16: 989.4 * _T, torch.float16: 989.4 * _T,
             torch.float8_e4m3fn: 1978.9 * _T},
    "h200 nvl": {torch.float32: 60 * _T, "tf32": 417.5 * _T, torch.bfloat16: 835.5 * _T, torch.float16: 835.5 * _T,
                 torch.float8_e4m3fn: 1670.5 * _T},
    "h100 sxm": {torch.float32: 66.9 * _T, "tf32": 494.7 * _T, torch.bfloat16: 989.4 * _T, torch.float16: 989.4 * _T,
                 torch.float8_e4m3fn: 1978.9 * _T},
    "h100 nvl": {torch.float32: 60 * _T, "tf32": 417.5 * _T, torch.bfloat16: 835.5 * _T, torch.float16: 835.5 * _T,
                 torch.float8_e4m3fn: 1670.5 * _T},
    "h100 pcie": {torch.float32: 51.2 * _T, "tf32": 378 * _T, torch.bfloat16: 756 * _T, torch.float16: 756 * _T,
                  torch.float8_e4m3fn: 1513 * _T},
    "a100": {torch.float32: 19.5 * _T, "tf32": 156 * _T, torch.bfloat16: 312 * _T, torch.float16: 312 * _T},
    "l40s": {torch.float32: 91.6 * _T, "tf32": 183 * _T, torch.bfloat16: 362 * _T, torch.float16: 362 * _T,
             torch.float8_e4m3fn: 733 * _T},
    "l4": {torch.float32: 30.3 * _T, "tf32": 60 * _T, torch.bfloat16: 121 * _T, torch.float16: 121 * _T,
           torch.float8_e4m3fn: 242.5 * _T},
    "a10": {torch.float32: 31.2 * _T, "tf32": 62.5 * _T, torch.bfloat16: 125 * _T, torch.float16: 125 * _T},
    "v100 sxm": {torch.float32: 15.7 * _T, torch.float16: 125 * _T},
    "v100 pcie": {torch.float32: 14 * _T, torch.float16: 112 * _T},
    "t4": {torch.float32: 8.1 * _T, torch.float16: 65 * _T},
}  # fmt: skip
# torch.cuda.get_device_name() (lower case) -> the table's row; the first match wins.
_CUDA_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bb200\b", "b200"),
    (r"\bh200\b.*\bnvl\b", "h200 nvl"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bnvl\b", "h100 nvl"),
    (r"\bh100\b.*\b(pcie|hbm2e)\b", "h100 pcie"),
    (r"\bh100\b", "h100 sxm"),
    (r"\ba100\b", "a100"),
    (r"\bl40s\b", "l40s"),
    (r"\bl4\b", "l4"),
    (r"\ba10\b", "a10"),
    (r"\bv100s?\b.*\bpcie\b", "v100 pcie"),
    (r"\bv100\b", "v100 sxm"),
    (r"\bt4\b", "t4"),
)


def cuda_peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """The table's dense peak FLOP/s for a CUDA device called ``device_name`` in ``dtype``
    (a torch dtype, or ``"tf32"``); None when the device or the dtype is not in the table."""
    name = device_name.lower()
    row = next((row for pattern, row in _CUDA_NAMES if re.search(pattern, name)), None)
    return None if row is None else _CUDA_PEAK_FLOPS[row].get(dtype)


def get_available_flops(device: torch.device, dtype: torch.dtype | str) -> int | None:
    """Peak FLOP/s of ``device`` computing in ``dtype`` (Fabric's function): the table's figure
    for common CUDA GPUs (float32 counts as TF32 on Ampere and newer when
    ``torch.get_float32_matmul_precision()`` is not ``"highest"``); None for the CPU and for a
    device or dtype the table does not hold (with a warning for an unknown GPU: pass
    ``available_flops`` yourself)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            dtype = "tf32"
    peak = cuda_peak_flops(name, dtype)
    if peak is None:
        warnings.warn(
            f"the peak FLOP/s of {name!r} in {dtype} is not in hasten's table, so MFU is left out; "
            "pass available_flops=<the device's peak FLOP/s> to ThroughputMonitor for it",
            stacklevel=2,
        )
        return None
    return int(peak)


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """The most memory this process has held: the allocator's ``max_memory_allocated`` on an
    accelerator (since the start, or since ``torch.accelerator.reset_peak_memory_stats``), the
    peak resident set size on the CPU; None where neither is known."""
    device = torch.device(device)
    if device.type == "cpu":
        try:
            import resource
        except ImportError:  # Windows
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
    current = torch.accelerator.current_accelerator()
    if current is None or current.type != device.type:
        return None
    return torch.accelerator.max_memory_allocated(device)
