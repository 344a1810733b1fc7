"""The throughput meter (hasten.training.throughput): figures against hand counts, the window
arithmetic with given times, the tracker call, the table of peaks, and no sync in update()."""

from __future__ import annotations

import math
import resource
import sys
import warnings

import pytest
import torch

from hasten import Accelerator, GeneralTracker
from hasten.training import throughput as tp
from hasten.training.throughput import (
    Throughput,
    ThroughputMonitor,
    get_available_flops,
    measure_flops,
    peak_memory_bytes,
)

B, IN, OUT = 4, 16, 8
LINEAR_FORWARD = 2 * B * IN * OUT  # one (B, IN) @ (IN, OUT) product: B*IN*OUT multiply-adds


class FakeAccelerator:
    """What ThroughputMonitor reads from an Accelerator, with the log calls kept."""

    def __init__(self, num_processes: int = 1, mixed_precision: str = "no") -> None:
        self.device = torch.device("cpu")
        self.num_processes = num_processes
        self.mixed_precision = mixed_precision
        self.logged: list[tuple[dict, int | None]] = []

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        self.logged.append((dict(values), step))
        self.log_kwargs = log_kwargs


def test_measure_flops_of_a_linear_layer_against_the_hand_count():
    layer = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, IN, requires_grad=True)
    assert measure_flops(layer, lambda: layer(x)) == LINEAR_FORWARD
    # backward: the gradient of the input and of the weight, each a product as big as the forward
    assert measure_flops(layer, lambda: layer(x), lambda y: y.sum()) == 3 * LINEAR_FORWARD
    # an input that needs no gradient: only the weight's
    plain = torch.randn(B, IN)
    assert measure_flops(layer, lambda: layer(plain), lambda y: y.sum()) == 2 * LINEAR_FORWARD
    # on the meta device: the same count, nothing computed
    with torch.device("meta"):
        meta, meta_x = torch.nn.Linear(IN, OUT), torch.empty(B, IN, requires_grad=True)
    assert measure_flops(meta, lambda: meta(meta_x), lambda y: y.sum()) == 3 * LINEAR_FORWARD


def test_measure_flops_leaves_the_gradients_as_they_were():
    layer = torch.nn.Linear(IN, OUT)
    layer.weight.grad = torch.full_like(layer.weight, 7.0)
    measure_flops(layer, lambda: layer(torch.randn(B, IN)), lambda y: y.sum())
    assert torch.equal(layer.weight.grad, torch.full_like(layer.weight, 7.0)) and layer.bias.grad is None


def test_measure_flops_refuses_bad_arguments():
    layer = torch.nn.Linear(IN, OUT)
    with pytest.raises(TypeError, match=r"measure_flops: model must be a torch.nn.Module, got 3 \(int\)"):
        measure_flops(3, lambda: None)
    with pytest.raises(TypeError, match="measure_flops.forward_fn must be a callable, got"):
        measure_flops(layer, layer(torch.randn(B, IN)))
    with pytest.raises(TypeError, match="measure_flops.loss_fn must be a callable or None, got 'sum'"):
        measure_flops(layer, lambda: layer(torch.randn(B, IN)), "sum")


def test_window_arithmetic_with_given_times():
    meter = Throughput(available_flops=400.0, world_size=2, window_size=3)
    # totals so far at each update; flops since the previous update (none given on the first two)
    for t, batches, samples, lengths, flops in [
        (1.0, 1, 10, 100, None),
        (2.0, 2, 20, 200, None),
        (4.0, 3, 30, 300, 100),
        (7.0, 4, 40, 400, 200),
    ]:
        meter.update(time=t, batches=batches, samples=samples, lengths=lengths, flops=flops)
    got = meter.compute()
    # the window holds the newest 3 updates: times 2, 4, 7 (5 s), batches 2 -> 4, samples 20 -> 40
    expected = {
        "time": 7.0,
        "batches": 4,
        "samples": 40,
        "lengths": 400,
        "device/batches_per_sec": 2 / 5,
        "device/samples_per_sec": 20 / 5,
        "device/items_per_sec": 200 / 5,
        "device/flops_per_sec": (100 + 200) / 5,  # the flops of the points after the first
        "batches_per_sec": 2 * 2 / 5,  # world figures: the device's times world_size
        "samples_per_sec": 2 * 20 / 5,
        "items_per_sec": 2 * 200 / 5,
        "flops_per_sec": 2 * 300 / 5,
        "device/mfu": 300 / 5 / 400.0,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_rates_from_the_second_update_and_flops_from_where_they_start():
    meter = Throughput(window_size=100, separator=".")
    meter.update(time=0.5, batches=1, samples=8)
    assert meter.compute() == {"time": 0.5, "batches": 1, "samples": 8}  # one point: no rate yet
    meter.update(time=1.0, batches=2, samples=16)
    meter.update(time=2.0, batches=3, samples=24, flops=30)
    meter.update(time=4.0, batches=4, samples=32, flops=50)
    got = meter.compute()
    assert got["device.samples_per_sec"] == pytest.approx(24 / 3.5)
    # flops known since t=1.0 (the third point's were done between t=1 and t=2): 80 over 3 s
    assert got["device.flops_per_sec"] == pytest.approx(80 / 3.0)
    assert "samples_per_sec" not in got and "device.mfu" not in got  # one process, no peak given
    meter.reset()
    with pytest.raises(RuntimeError, match=r"Throughput.compute: no update\(\) yet"):
        meter.compute()


def test_a_refused_update_changes_nothing():
    meter = Throughput(window_size=4)
    meter.update(time=1.0, batches=1, samples=4)
    meter.update(time=2.0, batches=2, samples=8)
    before = meter.compute()
    refusals = [
        (dict(time=3.0, batches=3, samples=2), ValueError, r"Throughput.update.samples must be >= 3, got 2"),
        (dict(time=2.0, batches=3, samples=12), ValueError, r"time must increase at each update.*got 2.0 after 2.0"),
        (dict(time=3.0, batches=2, samples=12), ValueError, r"batches must increase at each update.*got 2 after 2"),
        (dict(time=3.0, batches=3, samples=12, lengths=5), ValueError, r"update.lengths must be >= 12, got 5"),
        (dict(time=3.0, batches=3, samples=12, flops=-1), ValueError, r"update.flops must be >= 0, got -1"),
        (dict(time=3.0, batches=3.0, samples=12), TypeError, r"update.batches must be an integer, got 3.0"),
        (dict(time=math.nan, batches=3, samples=12), ValueError, r"update.time must be a finite number, got nan"),
        (dict(time=3.0, batches=3, samples=torch.tensor(12)), TypeError, r"update.samples must be an integer"),
    ]
    for kwargs, error, message in refusals:
        with pytest.raises(error, match=message):
            meter.update(**kwargs)
        assert meter.compute() == before
    for kwargs, error, message in [
        (dict(window_size=1), ValueError, r"Throughput.window_size must be >= 2, got 1"),
        (dict(world_size=0), ValueError, r"Throughput.world_size must be >= 1, got 0"),
        (dict(available_flops=-5), ValueError, r"Throughput.available_flops must be > 0, got -5"),
        (dict(separator=1), TypeError, r"Throughput.separator must be a str, got 1"),
    ]:
        with pytest.raises(error, match=message):
            Throughput(**kwargs)


def test_update_never_reads_a_tensor_syncs_or_runs_a_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("update() must not synchronise, read a tensor or run a collective")

    import torch.distributed as dist

    for owner, name in [
        (torch.cuda, "synchronize"),
        (torch.accelerator, "synchronize"),
        (torch.Tensor, "item"),
        (torch.Tensor, "tolist"),
        (dist, "all_reduce"),
        (dist, "all_gather"),
        (dist, "all_gather_object"),
        (dist, "barrier"),
        (dist, "broadcast"),
    ]:
        monkeypatch.setattr(owner, name, forbidden)
    monkeypatch.setattr(tp, "peak_memory_bytes", forbidden)  # memory is read by compute() only
    accelerator = FakeAccelerator(num_processes=4)
    monitor = ThroughputMonitor(accelerator, window_size=10, flops_per_batch=5, sequence_length=16)
    for i in range(1, 1001):
        monitor.update(time=i * 0.01, batches=i, samples=4 * i)
    assert len(monitor._window) == 10 and accelerator.logged == []  # a fixed-size window, nothing sent


def test_monitor_logs_to_the_accelerators_trackers_with_one_call():
    accelerator = FakeAccelerator(num_processes=2)
    monitor = ThroughputMonitor(accelerator, window_size=5, flops_per_batch=LINEAR_FORWARD, available_flops=1e6)
    monitor.update(time=1.0, batches=2, samples=8)
    monitor.update(time=3.0, batches=4, samples=16)  # 2 batches since the last update: 2 x the batch's FLOPs
    got = monitor.compute_and_log()
    assert accelerator.logged == [(got, 0)]
    assert got["device/flops_per_sec"] == pytest.approx(2 * LINEAR_FORWARD / 2.0)
    assert got["flops_per_sec"] == pytest.approx(2 * LINEAR_FORWARD)  # 2 processes
    assert got["device/mfu"] == pytest.approx(LINEAR_FORWARD / 1e6)
    assert got["device/peak_memory_gib"] > 0  # the process's peak RSS on the CPU
    monitor.update(time=4.0, batches=5, samples=20)
    monitor.compute_and_log()
    monitor.compute_and_log(step=40)
    assert [step for _, step in accelerator.logged] == [0, 1, 40]  # Fabric's counting, or the step given
    with pytest.raises(ValueError, match=r"ThroughputMonitor.compute_and_log.step must be >= 0, got -1"):
        monitor.compute_and_log(step=-1)
    assert monitor.step == 40 and len(accelerator.logged) == 3
    monitor.compute_and_log(log_kwargs={"wandb": {"commit": False}})  # passed on to accelerator.log
    assert accelerator.log_kwargs == {"wandb": {"commit": False}} and accelerator.logged[-1][1] == 41
    with pytest.raises(TypeError, match=r"ThroughputMonitor: accelerator must be a hasten Accelerator.*without log"):
        ThroughputMonitor(object())
    with pytest.raises(ValueError, match=r"ThroughputMonitor.sequence_length must be >= 1, got 0"):
        ThroughputMonitor(accelerator, sequence_length=0)
    with pytest.raises(ValueError, match=r"ThroughputMonitor.flops_per_batch must be >= 0, got -2"):
        monitor.flops_per_batch = -2
    with pytest.raises(TypeError, match=r"ThroughputMonitor.sequence_length must be an integer, got '8'"):
        monitor.sequence_length = "8"
    assert monitor.flops_per_batch == LINEAR_FORWARD and monitor.sequence_length is None


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, int | None]] = []

    @property
    def tracker(self):
        return self.logged

    def log(self, values, step=None, **kwargs):
        self.logged.append((dict(values), step))


def test_a_real_accelerator_every_tracker_a_hand_counted_linear_model():
    first, second = Recorder(), Recorder()
    second.name = "second"
    accelerator = Accelerator(log_with=[first, second])
    accelerator.init_trackers("throughput")
    layer = torch.nn.Linear(IN, OUT)
    with torch.device("meta"):
        meta, meta_x = torch.nn.Linear(IN, OUT), torch.empty(B, IN)
    per_batch = measure_flops(meta, lambda: meta(meta_x), lambda y: y.sum())
    assert per_batch == 2 * LINEAR_FORWARD  # forward + the weight's gradient (the input needs none)
    monitor = ThroughputMonitor(accelerator, window_size=3, flops_per_batch=per_batch, sequence_length=10)
    assert monitor.world_size == 1 and monitor.available_flops is None  # the CPU's peak is not known
    for i in range(1, 5):
        layer(torch.randn(B, IN)).sum().backward()
        monitor.update(time=float(i), batches=i, samples=B * i)  # given times: one batch a second
    got = monitor.compute_and_log(step=7)
    assert first.logged == second.logged == [(got, 7)]
    assert got["device/samples_per_sec"] == pytest.approx(B)
    assert got["device/items_per_sec"] == pytest.approx(10 * B)  # tokens: samples x sequence_length
    assert got["device/flops_per_sec"] == pytest.approx(2 * LINEAR_FORWARD)
    assert "device/mfu" not in got and "samples_per_sec" not in got
    accelerator.end_training()


def test_the_table_of_peaks(monkeypatch):
    assert tp.cuda_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert tp.cuda_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    assert tp.cuda_peak_flops("NVIDIA H100 NVL", torch.float16) == pytest.approx(835.5e12)
    assert tp.cuda_peak_flops("NVIDIA H200", torch.bfloat16) == pytest.approx(989.4e12)
    assert tp.cuda_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5e12)
    assert tp.cuda_peak_flops("NVIDIA L40S", torch.bfloat16) == pytest.approx(362e12)
    assert tp.cuda_peak_flops("NVIDIA L4", torch.bfloat16) == pytest.approx(121e12)
    assert tp.cuda_peak_flops("Tesla V100-PCIE-16GB", torch.float16) == pytest.approx(112e12)
    assert tp.cuda_peak_flops("Tesla T4", torch.bfloat16) is None  # no bf16 on Turing
    assert tp.cuda_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # not in the table
    assert get_available_flops(torch.device("cpu"), torch.bfloat16) is None

    # a CUDA device as torch reports it (this machine has none)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert get_available_flops(cuda, torch.bfloat16) == int(989.4e12)
    assert get_available_flops(cuda, torch.float32) == int(66.9e12)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert get_available_flops(cuda, torch.float32) == int(494.7e12)  # float32 matmuls run as TF32
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Quantum X1")
    with pytest.warns(UserWarning, match=r"peak FLOP/s of 'NVIDIA Quantum X1' in torch.bfloat16 is not in"):
        assert get_available_flops(cuda, torch.bfloat16) is None


def test_the_monitor_takes_the_peak_for_the_accelerators_precision(monkeypatch):
    calls = []
    monkeypatch.setattr(tp, "get_available_flops", lambda device, dtype: calls.append(dtype) or 1e15)
    assert ThroughputMonitor(FakeAccelerator(mixed_precision="bf16")).available_flops == 1e15
    ThroughputMonitor(FakeAccelerator(mixed_precision="fp16"))
    ThroughputMonitor(FakeAccelerator(mixed_precision="no"))
    assert ThroughputMonitor(FakeAccelerator(), available_flops=5e14).available_flops == 5e14  # given: kept
    assert calls == [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_peak_memory_on_the_cpu_is_the_peak_resident_set():
    before = peak_memory_bytes("cpu")
    assert before == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    block = torch.ones(96 * 2**20, dtype=torch.uint8)  # 96 MiB, touched
    after = peak_memory_bytes(torch.device("cpu"))
    del block
    assert after >= before and after > 96 * 2**20
    assert peak_memory_bytes("meta") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_available_flops("cpu", torch.float32) is None  # no warning for the CPU
