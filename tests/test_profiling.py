"""Profiling: accelerator.profile() labels, schedules and export; the profile-report command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from conftest import SCRIPTS, torchrun
from hasten import Accelerator, ProfileKwargs, report
from hasten.data_loader.core import DataLoaderShard
from hasten.training.profiling import first_busy_step, is_profiling
from launch_utils import launch_env as clean_env

pytestmark = pytest.mark.filterwarnings("ignore:.*(Profiler clears events|won't be using warmup).*:UserWarning")

LABELS = ("hasten.forward", "hasten.backward", "hasten.optimizer_step", "hasten.data_wait")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- helpers


def _prepared(n_batches: int = 4, **accelerator_kwargs):
    acc = Accelerator(cpu=True, **accelerator_kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(2 * n_batches, 4), torch.randn(2 * n_batches, 2))
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=2))
    return acc, model, optimizer, loader


def _train(acc, model, optimizer, loader, prof=None, scale_loss=None):
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if scale_loss is not None:
                loss = loss * scale_loss(i)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if prof is not None:
            prof.step()


def _torch_reference(schedule, steps):
    """The step numbers at which plain torch.profiler calls on_trace_ready."""
    calls = []
    sched = torch.profiler.schedule(**schedule) if schedule else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(
        activities=activities, schedule=sched, on_trace_ready=lambda p: calls.append(p.step_num)
    ) as p:
        for _ in range(steps):
            torch.ones(2) + 1
            p.step()
    return calls


def _names(path):
    with open(path) as f:
        return [e.get("name") for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _events(path, name):
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("name") == name]


def _within(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


# ---------------------------------------------------------------------- schedules


SCHEDULES = [
    # (schedule_option, steps, on_trace_ready calls)
    (None, 3, 1),
    ({"wait": 0, "warmup": 0, "active": 2}, 5, 3),  # cycles end at steps 2 and 4; a partial one at exit
    ({"wait": 1, "warmup": 1, "active": 2}, 9, 2),
    ({"wait": 1, "warmup": 1, "active": 2, "repeat": 1}, 9, 1),
    ({"wait": 0, "warmup": 1, "active": 1, "repeat": 2, "skip_first": 3}, 10, 2),
    ({"wait": 2, "warmup": 1, "active": 3}, 5, 1),  # exits inside the active phase
]


@pytest.mark.parametrize("schedule,steps,expected", SCHEDULES)
def test_on_trace_ready_calls_match_torch(tmp_path, schedule, steps, expected):
    acc, model, optimizer, loader = _prepared(n_batches=steps)
    calls = []
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option=schedule,
        on_trace_ready=lambda p: calls.append(p.step_num),
        output_trace_dir=str(tmp_path),
    )
    with acc.profile(handler) as prof:
        _train(acc, model, optimizer, loader, prof)
    reference = _torch_reference(schedule, steps)
    assert len(reference) == expected
    assert calls == reference
    # One exported trace per call, named by cycle when there is a schedule.
    if schedule is None:
        assert sorted(os.listdir(tmp_path)) == ["trace_rank0.json"]
    else:
        assert sorted(os.listdir(tmp_path)) == sorted(f"trace_rank0_cycle{k}.json" for k in range(1, expected + 1))


def _step_ranges(prof):
    return sorted(e.name for e in prof.events() if e.name.startswith("ProfilerStep#"))


QUIET_SCHEDULES = [
    {"wait": 4, "warmup": 1, "active": 2},
    {"wait": 3, "warmup": 0, "active": 1, "repeat": 2, "skip_first": 2},
    {"wait": 0, "warmup": 1, "active": 2, "skip_first": 5},
    {"wait": 2, "warmup": 2, "active": 1, "repeat": 1},
]


@pytest.mark.parametrize("schedule", QUIET_SCHEDULES)
def test_idle_steps_skip_torchs_step_and_the_trace_is_the_same(monkeypatch, schedule):
    """While the schedule waits, prof.step() only counts; what torch records is unchanged."""
    steps = 20
    sched = torch.profiler.schedule(**{"wait": 0, "warmup": 0, **schedule})
    cpu = [torch.profiler.ProfilerActivity.CPU]

    def run(prof_cm):
        seen = []
        with prof_cm(lambda p: seen.append((p.step_num, _step_ranges(p)))) as prof:
            for _ in range(steps):
                torch.ones(2) + 1
                prof.step()
        return seen, prof.step_num

    reference = run(lambda ready: torch.profiler.profile(activities=cpu, schedule=sched, on_trace_ready=ready))
    acc, *_ = _prepared()
    torch_steps = []
    plain_step = torch.profiler.profile.step
    monkeypatch.setattr(
        torch.profiler.profile, "step", lambda self: torch_steps.append(self.step_num) or plain_step(self)
    )
    ours = run(
        lambda ready: acc.profile(ProfileKwargs(activities=["cpu"], schedule_option=schedule, on_trace_ready=ready))
    )
    assert ours == reference and reference[0]  # the same cycles, at the same steps, with the same step ranges
    NONE = torch.profiler.ProfilerAction.NONE
    # torch's own step() ran only where the schedule was busy before or after the step.
    assert torch_steps == [n for n in range(steps) if not (sched(n) is NONE and sched(n + 1) is NONE)]
    assert len(torch_steps) < steps


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 6), st.integers(0, 3), st.integers(1, 3), st.integers(0, 3), st.integers(0, 6), st.integers(0, 60)
)
def test_first_busy_step_agrees_with_torchs_schedule(wait, warmup, active, repeat, skip_first, step):
    option = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat, "skip_first": skip_first}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = torch.profiler.schedule(**option)
    busy = [n for n in range(step, 200) if sched(n) is not torch.profiler.ProfilerAction.NONE]
    assert first_busy_step(option, step) == (busy[0] if busy else None)


def test_without_output_dir_the_callback_is_torchs_own(tmp_path):
    acc, *_ = _prepared()

    def callback(prof):
        pass

    with acc.profile(ProfileKwargs(on_trace_ready=callback)) as prof:
        torch.ones(3) * 2
    assert prof.on_trace_ready is callback
    assert not os.listdir(tmp_path)


def test_step_with_optimizer_counts_real_steps_not_micro_steps(tmp_path):
    acc, model, optimizer, loader = _prepared(n_batches=8, gradient_accumulation_steps=2)
    calls = []
    schedule = {"wait": 0, "warmup": 1, "active": 1}
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option=schedule,
        step_with_optimizer=True,
        on_trace_ready=lambda p: calls.append(p.step_num),
        output_trace_dir=str(tmp_path),
    )
    with acc.profile(handler) as prof:
        _train(acc, model, optimizer, loader)  # no prof.step(): the optimizer steps the profiler
    assert optimizer.real_steps == 4 and prof.step_num == 4
    assert calls == _torch_reference(schedule, 4) == [2, 4]
    names = _names(tmp_path / "trace_rank0_cycle1.json")
    assert sum(n.startswith("ProfilerStep#") for n in names) == 1  # one active step per cycle


def test_step_with_optimizer_skips_fp16_overflow_steps():
    acc, model, optimizer, loader = _prepared(n_batches=6, mixed_precision="fp16")
    skipped = []
    with acc.profile(ProfileKwargs(activities=["cpu"], step_with_optimizer=True)) as prof:
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss * (float("inf") if i in (1, 3) else 1.0))
            optimizer.step()
            skipped.append(optimizer.step_was_skipped)
            optimizer.zero_grad()
    assert skipped == [False, True, False, True, False, False]
    assert optimizer.real_steps == 4 and prof.step_num == 4


def test_step_with_optimizer_needs_a_prepared_optimizer():
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="step_with_optimizer=True .* no optimizer has been prepared"):
        with acc.profile(ProfileKwargs(step_with_optimizer=True)):
            pass


def test_handler_and_argument_validation():
    with pytest.raises(TypeError, match=r"ProfileKwargs.step_with_optimizer must be True or False, got 1"):
        ProfileKwargs(step_with_optimizer=1)
    assert ProfileKwargs(step_with_optimizer=True).to_kwargs() == {"step_with_optimizer": True}
    acc, *_ = _prepared()
    with pytest.raises(TypeError, match="profile_handler must be a ProfileKwargs"):
        with acc.profile({"activities": ["cpu"]}):
            pass
    with pytest.raises(ValueError, match="non-empty"):
        acc.record_function("  ")
    with pytest.raises(TypeError, match="must be a str, got 3"):
        acc.record_function(3)


def test_no_completed_cycle_warns_and_writes_nothing(tmp_path):
    acc, model, optimizer, loader = _prepared(n_batches=2)
    handler = ProfileKwargs(
        activities=["cpu"], schedule_option={"wait": 5, "warmup": 0, "active": 1}, output_trace_dir=str(tmp_path)
    )
    with pytest.warns(UserWarning, match="rank 0 completed no active profiling cycle"):
        with acc.profile(handler) as prof:
            _train(acc, model, optimizer, loader, prof)
    assert not os.listdir(tmp_path)


def test_a_new_profile_replaces_old_traces(tmp_path):
    for name in ("trace_rank0_cycle7.json", "trace_rank0.json", "trace_rank3.json", "notes.json"):
        (tmp_path / name).write_text("{}")
    acc, *_ = _prepared()
    with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
        torch.ones(2) + 1
    # This run's single rank rewrote rank 0; ranks beyond this run's world size are gone.
    assert sorted(os.listdir(tmp_path)) == ["notes.json", "trace_rank0.json"]
    assert json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]


# ---------------------------------------------------------------------- labels


def test_labels_wrap_the_step_and_user_ranges(tmp_path):
    acc, model, optimizer, loader = _prepared(n_batches=5)
    with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
        for x, y in loader:
            with acc.record_function("my.loss"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    path = tmp_path / "trace_rank0.json"
    names = _names(path)
    counts = {label: names.count(label) for label in (*LABELS, "my.loss")}
    # 5 batches; the 6th wait is the one that finds the end of the loader.
    assert counts == {
        "hasten.forward": 5,
        "hasten.backward": 5,
        "hasten.optimizer_step": 5,
        "hasten.data_wait": 6,
        "my.loss": 5,
    }
    forwards, steps = _events(path, "hasten.forward"), _events(path, "hasten.optimizer_step")
    # The labels sit around the real work: matmuls inside forward, torch's SGD step inside ours.
    addmm = [e for e in _events(path, "aten::addmm")]
    assert addmm and all(any(_within(a, f) for f in forwards) for a in addmm)
    sgd = [
        e for e in json.loads(path.read_text())["traceEvents"] if str(e.get("name")).startswith("Optimizer.step#SGD")
    ]
    assert len(sgd) == 5 and all(any(_within(s, o) for o in steps) for s in sgd)
    # The forward label is inside the user's own range around it.
    mine = _events(path, "my.loss")
    assert all(any(_within(f, m) for m in mine) for f in forwards)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_labels_are_removed_on_exit(mixed_precision):
    acc, model, optimizer, loader = _prepared(mixed_precision=mixed_precision)
    forward_before = model.__dict__.get("forward")  # the autocast wrapper with bf16, none otherwise
    assert (forward_before is None) is (mixed_precision == "no")
    with acc.profile(ProfileKwargs(activities=["cpu"])):
        assert is_profiling(acc)
        assert type(loader) is not DataLoaderShard and isinstance(loader, DataLoaderShard)
        assert model.forward._hasten_label == "hasten.forward"
        assert optimizer.step._hasten_label == "hasten.optimizer_step"
        with pytest.raises(RuntimeError, match="already active"):
            with acc.profile(ProfileKwargs(activities=["cpu"])):
                pass
        _train(acc, model, optimizer, loader)
    assert not is_profiling(acc)
    assert type(loader) is DataLoaderShard
    assert model.__dict__.get("forward") is forward_before
    assert "backward" not in acc.__dict__ and "step" not in optimizer.__dict__
    # Outside profile() nothing of ours runs: a plain torch profiler sees no hasten ranges.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as plain:
        _train(acc, model, optimizer, loader)
    names = {e.key for e in plain.key_averages()}
    assert "aten::addmm" in names and not any(n.startswith("hasten.") for n in names)


def test_labels_are_removed_when_the_block_raises(tmp_path):
    acc, model, optimizer, loader = _prepared()
    with pytest.raises(KeyError, match="boom"):
        with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
            _train(acc, model, optimizer, loader)
            raise KeyError("boom")
    assert not is_profiling(acc) and type(loader) is DataLoaderShard
    assert "forward" not in model.__dict__ and "step" not in optimizer.__dict__
    assert os.listdir(tmp_path) == ["trace_rank0.json"]  # torch still finished the trace


# ---------------------------------------------------------------------- two processes


def _launch_two(script, *args, timeout):
    """2 processes through `hasten launch` (torch.distributed.run underneath) where the CLI exists."""
    try:
        from launch_utils import launch
    except ImportError:  # the CLI is not there: torch.distributed.run directly
        return torchrun(script, *map(str, args), timeout=timeout)
    return launch("--num_processes", "2", script, *args, timeout=timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = _launch_two(SCRIPTS / "profile_train.py", out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, results


def test_two_ranks_profile_and_restore(two_ranks):
    _, results = two_ranks
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world_size"] == 2
        assert res["during"] == {
            "is_profiling": True,
            "loader_class_swapped": True,
            "forward_labelled": "hasten.forward",
            "backward_labelled": "hasten.backward",
            "step_labelled": "hasten.optimizer_step",
        }
        assert res["after"] == {
            "is_profiling": False,
            "loader_class": "DataLoaderShard",
            "loader_class_restored": True,
            "forward_in_dict": False,
            "backward_in_dict": False,
            "step_in_dict": False,
        }
        # 12 micro-steps, accumulation 2: 6 optimizer steps stepped the schedule (wait 0, warmup 1,
        # active 2, repeat 2): two cycles, ready at steps 3 and 6.
        assert res["real_steps"] == 6 and res["profiler_step_num"] == 6
        assert res["trace_ready_steps"] == [3, 6]
    # When profile() returned on the main process, every rank's traces were written.
    assert results[0]["traces_after_exit"] == [f"trace_rank{r}_cycle{k}.json" for r in (0, 1) for k in (1, 2)]


def test_two_rank_traces_hold_the_labels(two_ranks):
    out, _ = two_ranks
    for r in range(2):
        names: list = []
        for k in (1, 2):
            data = json.loads((out / "traces" / f"trace_rank{r}_cycle{k}.json").read_text())
            assert data["distributedInfo"]["rank"] == r and data["distributedInfo"]["world_size"] == 2
            names += [e.get("name") for e in data["traceEvents"] if e.get("ph") == "X"]
        # 2 active steps per cycle x 2 cycles, each step = 2 micro-steps.
        assert names.count("hasten.forward") == 8 and names.count("hasten.backward") == 8
        assert names.count("user.loss") == 8
        assert names.count("hasten.optimizer_step") == 8  # a call per micro-step (no-op on the first)
        assert names.count("hasten.data_wait") >= 8
        assert sum(str(n).startswith("ProfilerStep#") for n in names) == 4


def test_report_from_two_ranks(two_ranks, capsys):
    out, _ = two_ranks
    traces = out / "traces"
    merged = out / "merged.json"
    assert report.main([str(traces), "--top", "5", "--merged", str(merged), "--no-png"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "hasten profile report: 2 ranks"
    breakdown = lines[lines.index(next(line for line in lines if line.startswith("Per-step"))) + 1 :][:3]
    assert breakdown[0].split() == ["rank", "steps", "step", "forward", "backward", "optimizer", "data", "other"]
    assert [row.split()[:2] for row in breakdown[1:]] == [["0", "4"], ["1", "4"]]
    assert "slowest step: rank" in text and "steps from ProfilerStep ranges" in text
    top = lines.index("Top 5 operators by self CPU time (ms, summed over the profiled steps)")
    assert lines[top + 1].split() == ["operator", "calls", "rank", "0", "rank", "1", "spread", "most"]
    assert len([line for line in lines[top + 2 : top + 7] if line.split()[-2] == "rank"]) == 5
    assert any(line.startswith("user.loss") for line in lines)

    # The merged trace: one process row per rank (plus Kineto's bookkeeping row), all events kept.
    data = json.loads(merged.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    host = {name: pid for pid, name in rows.items() if name in ("rank 0", "rank 1")}
    assert sorted(host) == ["rank 0", "rank 1"] and host["rank 0"] != host["rank 1"]
    for name, pid in host.items():
        labels = [e for e in data["traceEvents"] if e.get("pid") == pid and e.get("name") == "hasten.forward"]
        assert len(labels) == 8, name
    assert all(isinstance(e["pid"], int) for e in data["traceEvents"])
    originals = sum(
        len(
            [
                e
                for e in json.loads(p.read_text())["traceEvents"]
                if e.get("ph") != "M" or e["name"] not in report._PROCESS_META
            ]
        )
        for p in traces.glob("trace_rank*.json")
    )
    assert (
        len([e for e in data["traceEvents"] if e.get("ph") != "M" or e["name"] not in report._PROCESS_META])
        == originals
    )


def test_chart_from_two_ranks(two_ranks, capsys):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib: pip install 'hasten[report]'")
    from PIL import Image  # a dependency of matplotlib

    out, _ = two_ranks
    png = out / "chart.png"
    assert report.main([str(out / "traces"), "--png", str(png), "--merged", str(out / "m.json")]) == 0
    assert f"chart: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()  # a complete, uncorrupted PNG
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width >= 1000 and image.height >= 350


# ---------------------------------------------------------------------- the report on made-up traces


def _x(name, ts, dur, cat="cpu_op", pid=100, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _write(directory, name, events, base_ns=0, world_size=None):
    data = {"traceEvents": events, "baseTimeNanoseconds": base_ns}
    if world_size is not None:
        data["distributedInfo"] = {"rank": 0, "world_size": world_size}
    (directory / name).write_text(json.dumps(data))


def _step_events(pid=100):
    ann = "user_annotation"
    return [
        _x("ProfilerStep#1", 0, 100, ann, pid),
        _x("ProfilerStep#2", 100, 100, ann, pid),
        _x("hasten.data_wait", 0, 5, ann, pid),
        _x("hasten.forward", 5, 30, ann, pid),
        _x("hasten.forward", 10, 10, ann, pid),  # nested (a prepared submodule): counted once
        _x("hasten.backward", 40, 40, ann, pid),
        _x("hasten.optimizer_step", 80, 10, ann, pid),
        _x("hasten.data_wait", 100, 5, ann, pid),
        _x("hasten.forward", 105, 20, ann, pid),
        _x("hasten.backward", 130, 40, ann, pid),
        _x("hasten.optimizer_step", 170, 10, ann, pid),
        _x("mine", 5, 20, ann, pid),
    ]


def test_self_times_subtract_nested_operators():
    events = [
        _x("A", 0, 100),
        _x("B", 10, 30),
        _x("D", 15, 10),
        _x("C", 50, 20),
        _x("A", 0, 7, tid=2),  # another thread
        _x("hasten.forward", 0, 100, "user_annotation"),  # not an operator
    ]
    stats = report.self_times(events)
    assert {k: (s.calls, s.self_us, s.total_us) for k, s in stats.items()} == {
        "A": (2, 57.0, 107.0),
        "B": (1, 20.0, 30.0),
        "C": (1, 20.0, 20.0),
        "D": (1, 10.0, 10.0),
    }


def test_step_breakdown_from_profiler_steps_and_without():
    b = report.step_breakdown(_step_events())
    assert b is not None and b.steps == 2 and b.from_profiler_steps and b.step_us == 100
    assert b.phases_us == {"forward": 25.0, "backward": 40.0, "optimizer": 10.0, "data": 5.0, "other": 20.0}
    no_steps = [e for e in _step_events() if not e["name"].startswith("ProfilerStep")]
    b = report.step_breakdown(no_steps)
    assert b is not None and not b.from_profiler_steps and b.steps == 2  # two optimizer steps
    assert b.step_us == 90 and b.phases_us["backward"] == 40.0  # span 0..180 over 2 steps
    assert report.step_breakdown([_x("aten::mm", 0, 5)]) is None


def test_merge_gives_each_rank_its_rows_and_aligns_clocks(tmp_path):
    gpu = [
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
        _x("sgemm_kernel", 20, 5, "kernel", pid=0, tid=7),
    ]
    meta = [
        {"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 100, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 1, "args": {"name": "main"}},
    ]
    flow = [
        {"ph": "s", "id": 1, "pid": 100, "tid": 1, "ts": 1, "cat": "ac2g", "name": "launch"},
        {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 20, "cat": "ac2g", "name": "launch", "bp": "e"},
    ]
    for rank, base in ((0, 5_000_000), (1, 7_000_000)):
        _write(tmp_path, f"trace_rank{rank}.json", meta + gpu + flow + _step_events(), base_ns=base)
    traces = report.load_traces(str(tmp_path))
    merged = report.merge_traces(traces)
    events = merged["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(rows.values()) == ["rank 0", "rank 0 · GPU 0", "rank 1", "rank 1 · GPU 0"]
    pid = {name: p for p, name in rows.items()}
    # The kernel of rank 1 is on rank 1's GPU row, 2000 µs later (its clock base is 2 ms later).
    kernels = {e["pid"]: e["ts"] for e in events if e.get("name") == "sgemm_kernel"}
    assert kernels == {pid["rank 0 · GPU 0"]: 20, pid["rank 1 · GPU 0"]: 2020}
    thread_names = [e for e in events if e.get("name") == "thread_name"]
    assert {e["pid"] for e in thread_names} == {pid["rank 0"], pid["rank 1"]}
    # Flow arrows stay within their rank: the ids differ between ranks, and match within one.
    ids = {(e["pid"], e["ph"]): e["id"] for e in events if e.get("cat") == "ac2g"}
    assert ids[(pid["rank 0"], "s")] == ids[(pid["rank 0 · GPU 0"], "f")]
    assert ids[(pid["rank 1"], "s")] == ids[(pid["rank 1 · GPU 0"], "f")]
    assert ids[(pid["rank 0"], "s")] != ids[(pid["rank 1"], "s")]
    assert merged["otherData"]["ranks"] == [0, 1]
    # The device kernels get their own table.
    text = report.format_report(report.analyse(traces))
    assert "Top 10 device kernels by time" in text and "sgemm_kernel" in text


def test_report_without_matplotlib_still_prints_and_merges(tmp_path, monkeypatch, capsys):
    for rank in (0, 1):
        _write(tmp_path, f"trace_rank{rank}.json", _step_events() + [_x("aten::mm", 10, 8 + rank)])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` now raises ImportError
    assert report.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "matplotlib is not installed" in text and "pip install 'hasten[report]'" in text
    assert "aten::mm" in text and "slowest" in text
    assert (tmp_path / report.MERGED_NAME).exists()
    assert not (tmp_path / report.PNG_NAME).exists()


def test_report_lines_for_made_up_traces(tmp_path, capsys):
    _write(tmp_path, "trace_rank0.json", _step_events() + [_x("aten::mm", 10, 8)])
    _write(tmp_path, "trace_rank1.json", _step_events() + [_x("aten::mm", 10, 16), _x("aten::mm", 40, 16)])
    assert report.main([str(tmp_path), "--no-png"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("aten::mm"))
    # calls, rank 0 ms, rank 1 ms, spread = (32 - 8) / 20, slowest rank.
    assert row.split() == ["aten::mm", "2", "0.01", "0.03", "120%", "rank", "1"]
    assert next(line for line in lines if line.startswith("mine")).split()[:2] == ["mine", "1"]
    assert not (tmp_path / report.PNG_NAME).exists()


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda d: None, r"no traces in .*expected trace_rank<N>\.json"),
        (lambda d: (d / "trace_rank0.json").write_text(""), r"trace .*trace_rank0\.json is empty"),
        (
            lambda d: (d / "trace_rank0.json").write_text('{"traceEvents": [{"ph": "X"'),
            r"trace_rank0\.json is not valid JSON \(.* line 1",
        ),
        (lambda d: (d / "trace_rank0.json").write_text('{"events": []}'), r"trace_rank0\.json is not a Chrome trace"),
        (
            lambda d: (d / "trace_rank0.json").write_text('{"traceEvents": [{"ph": "X", "name": "mm", "ts": 1}]}'),
            r"trace_rank0\.json: traceEvents\[0\] \('mm'\) .* without numeric 'ts' and 'dur'",
        ),
        (
            lambda d: [(d / f"trace_rank{r}.json").write_text('{"traceEvents": []}') for r in (0, 2)],
            r"missing trace for rank 1: .*trace_rank1\.json",
        ),
        (
            lambda d: _write(d, "trace_rank0.json", [], world_size=2),
            r"missing trace for rank 1: .*trace_rank1\.json .* 2 ranks",
        ),
        (
            lambda d: [
                (d / n).write_text('{"traceEvents": []}') for n in ("trace_rank0.json", "trace_rank0_cycle1.json")
            ],
            r"rank 0 has both .*trace_rank0\.json and .*trace_rank0_cycle1\.json",
        ),
    ],
    ids=["no-traces", "empty", "truncated", "not-chrome", "bad-event", "rank-gap", "world-size", "mixed-runs"],
)
def test_bad_traces_name_the_file(tmp_path, capsys, setup, message):
    setup(tmp_path)
    with pytest.raises(report.TraceError, match=message):
        report.load_traces(str(tmp_path))
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hasten profile-report: error: ") and str(tmp_path) in err


def test_report_arguments(tmp_path, capsys):
    with pytest.raises(report.TraceError, match=r"trace folder .*nowhere does not exist"):
        report.load_traces(str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path), "--top", "0"])
    assert exit_info.value.code == 2 and "--top: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_report_runs_without_torch(tmp_path):
    _write(tmp_path, "trace_rank0.json", _step_events() + [_x("aten::mm", 10, 8)])
    code = (
        "import sys, hasten.report as r; rc = r.main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), "--no-png"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "hasten profile report: 1 rank" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "hasten.report", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "missing does not exist" in proc.stderr


def test_label_names_are_shared_with_the_report():
    from hasten.training import labels, profiling

    assert labels.PHASES is report.PHASES and labels.TRACE_RE is report.TRACE_RE
    assert (profiling.FORWARD, profiling.BACKWARD, profiling.OPTIMIZER_STEP, profiling.DATA_WAIT) == LABELS
    assert [name for _, name in report.PHASES] == list(LABELS)
    assert profiling.trace_path("d", 3) == os.path.join("d", "trace_rank3.json")
    assert profiling.trace_path("d", 3, 2) == os.path.join("d", "trace_rank3_cycle2.json")
    assert report.TRACE_RE.match("trace_rank3_cycle2.json").groups() == ("3", "2")


def test_the_runtime_does_not_import_the_report():
    """profiling.py takes its label names from hasten.training.labels; the offline report stays out of training."""
    code = (
        "import sys, hasten, hasten.training.profiling; "
        "assert 'hasten.report' not in sys.modules, sorted(m for m in sys.modules if m.startswith('hasten'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr


def test_hasten_profile_report_command(tmp_path):
    """`hasten profile-report DIR` runs report.run, without importing torch."""
    pytest.importorskip("hasten.cli", reason="the hasten CLI is not in this tree")
    _write(tmp_path, "trace_rank0.json", _step_events() + [_x("aten::mm", 10, 8)])
    _write(tmp_path, "trace_rank1.json", _step_events() + [_x("aten::mm", 10, 9)])
    code = (
        "import sys; from hasten.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    args = ["profile-report", str(tmp_path), "--top", "3", "--no-png"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hasten profile report: 2 ranks") and "aten::mm" in proc.stdout
    assert json.loads((tmp_path / report.MERGED_NAME).read_text())["otherData"]["ranks"] == [0, 1]
    bad = subprocess.run(
        [sys.executable, "-c", code, "profile-report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "nope does not exist" in bad.stderr


# ---------------------------------------------------------------------- the report refuses before touching


def _event_file(d, events, name="trace_rank0.json", **top):
    (d / name).write_text(json.dumps({**top, "traceEvents": events}))


@pytest.mark.parametrize(
    "events,top,message",
    [
        # a dict pid was a TypeError traceback (unhashable) in the merge
        (
            [_x("mm", 0, 1, pid={"a": 1})],
            {},
            r"traceEvents\[0\] \('mm'\) has pid=\{'a': 1\}; pid must be an integer or a string",
        ),
        ([_x("mm", 0, 1, tid=[1])], {}, r"has tid=\[1\]; tid must be an integer or a string"),
        ([_x("mm", 0, 1, pid=True)], {}, r"has pid=True; pid must be an integer or a string"),
        ([{**_x("mm", 0, 1), "name": 5}], {}, r"has name=5; name must be a string"),
        ([_x("mm", 0, -1)], {}, r"has dur=-1; dur must be a duration >= 0"),
        ([{"ph": "i", "name": "mark", "ts": "soon"}], {}, r"has ts='soon'; ts must be a finite number"),
        (
            [{"ph": "M", "name": "process_labels", "pid": 1, "args": "CPU"}],
            {},
            r"has args='CPU'; args must be an object",
        ),
        (
            [{"ph": "s", "id": {"x": 1}, "pid": 1, "tid": 1, "ts": 0}],
            {},
            r"has id=\{'x': 1\}; id must be an integer or a string",
        ),
        ([], {"baseTimeNanoseconds": "now"}, r"baseTimeNanoseconds='now' must be a number >= 0"),
        (
            [],
            {"distributedInfo": {"rank": 0, "world_size": 0}},
            r"distributedInfo.world_size=0 must be an integer >= 1",
        ),
        (
            [],
            {"distributedInfo": {"rank": 1, "world_size": 2}},
            r"recorded by rank 1 \(its distributedInfo\), not rank 0",
        ),
    ],
    ids=[
        "pid-dict",
        "tid-list",
        "pid-bool",
        "name-int",
        "negative-dur",
        "ts-text",
        "args-text",
        "flow-id-dict",
        "base-text",
        "world-size-0",
        "rank-renamed",
    ],
)
def test_bad_trace_structure_is_named(tmp_path, capsys, events, top, message):
    _event_file(tmp_path, events, **top)
    with pytest.raises(report.TraceError, match=message):
        report.load_traces(str(tmp_path))
    assert report.main([str(tmp_path), "--no-png"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hasten profile-report: error: trace ") and "trace_rank0.json" in err
    assert not (tmp_path / report.MERGED_NAME).exists()


@pytest.mark.parametrize(
    "text,message",
    [
        ('[{"ph": "X"}]', "is not a Chrome trace"),
        ('{"traceEvents": {"ph": "X"}}', "is not a Chrome trace"),
        ('{"traceEvents": [], "traceEvents": []}', "the key 'traceEvents' appears twice"),
        ('{"traceEvents": []} []', r"is not valid JSON \(Extra data at line 1, column 21\)"),
        ('{"traceEvents": [{} {}]}', r"is not valid JSON \(Expecting ',' delimiter at line 1, column 21\)"),
        (
            '{"traceEvents": [\n{"ph": "X", "ts": 1, "dur": 2},\n{"ph": "X" "ts": 1}]}',
            r"not valid JSON \(Expecting ',' delimiter at line 3, column 12\)",
        ),
    ],
    ids=["list", "events-object", "twice", "extra", "no-comma", "line-3"],
)
def test_bad_trace_json_is_named_with_its_line(tmp_path, text, message):
    (tmp_path / "trace_rank0.json").write_text(text)
    with pytest.raises(report.TraceError, match=message):
        report.load_traces(str(tmp_path))


def test_not_utf8_trace(tmp_path):
    (tmp_path / "trace_rank0.json").write_bytes(b'{"traceEvents": [{"name": "\xff"}]}')
    with pytest.raises(report.TraceError, match=r"trace_rank0\.json is not a text \(JSON\) file"):
        report.load_traces(str(tmp_path))


@pytest.mark.timeout(60)
def test_non_regular_trace_files_are_refused(tmp_path, capsys):
    """A link to /dev/zero was read forever; a folder named like a trace was an IsADirectoryError."""
    (tmp_path / "trace_rank0.json").symlink_to("/dev/zero")
    with pytest.raises(
        report.TraceError,
        match=r"trace_rank0\.json is not a regular file \(a device, a pipe or a socket behind a link\)",
    ):
        report.load_traces(str(tmp_path))
    (tmp_path / "trace_rank0.json").unlink()
    (tmp_path / "trace_rank0.json").mkdir()
    assert report.main([str(tmp_path), "--no-png"]) == 2
    assert "trace_rank0.json is not a regular file (a folder)" in capsys.readouterr().err


def test_trace_size_limit_and_its_flag(tmp_path, capsys):
    events = [_x("aten::mm", i * 10, 5) for i in range(12_000)]  # about 1.1 MB
    _write(tmp_path, "trace_rank0.json", events)
    size = (tmp_path / "trace_rank0.json").stat().st_size
    assert 1e6 < size < 2e6
    assert report.main([str(tmp_path), "--no-png", "--max-trace-mb", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"is {size / 1e6:.1f} MB, more than the limit of 1 MB" in err and "--max-trace-mb 2" in err
    assert report.main([str(tmp_path), "--no-png", "--max-trace-mb", "2"]) == 0
    assert "aten::mm" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--max-trace-mb", "0"])
    assert "--max-trace-mb: must be a number of MB > 0, got '0'" in capsys.readouterr().err
    assert report.DEFAULT_MAX_TRACE_MB == 1024


def test_output_location_is_checked_before_the_work(tmp_path, capsys):
    """A merged-trace folder that cannot be written was an OSError after the table was printed."""
    _write(tmp_path, "trace_rank0.json", _step_events() + [_x("aten::mm", 10, 8)])
    missing = tmp_path / "nowhere" / "m.json"
    assert report.main([str(tmp_path), "--no-png", "--merged", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert (
        out == "" and f"cannot write the merged trace to {missing}: the folder {missing.parent} does not exist" in err
    )
    assert report.main([str(tmp_path), "--no-png", "--merged", str(tmp_path)]) == 2
    assert "it is a folder; give a file path" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert report.main([str(tmp_path), "--no-png", "--merged", str(tmp_path / "file" / "m.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "trace_rank0.json"]  # no temporary files left


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(tmp_path, capsys):
    _write(tmp_path, "trace_rank0.json", _step_events())
    out_dir = tmp_path / "ro"
    out_dir.mkdir()
    out_dir.chmod(0o555)
    try:
        assert report.main([str(tmp_path), "--no-png", "--merged", str(out_dir / "m.json")]) == 2
    finally:
        out_dir.chmod(0o755)
    out, err = capsys.readouterr()
    assert out == "" and "cannot write the merged trace to" in err and "Permission denied" in err


@pytest.mark.parametrize(
    "setup,message",
    [
        (
            lambda d: [_write(d, f"trace_rank{r}.json", _step_events(), world_size=w) for r, w in ((0, 2), (1, 3))],
            r"world sizes differ \(trace_rank0\.json: 2; trace_rank1\.json: 3\)",
        ),
        # rank 1 recorded 2 hours after rank 0 (baseTimeNanoseconds is the wall clock of ts 0)
        (
            lambda d: [
                _write(
                    d, f"trace_rank{r}.json", _step_events(), base_ns=1_790_000_000_000_000_000 + r * 7_200_000_000_000
                )
                for r in (0, 1)
            ],
            r"rank 0's events end at 2026-09-21 \d\d:\d\d:\d\d UTC and rank 1's begin at .* 7200 s later",
        ),
        (
            lambda d: [_write(d, f"trace_rank0_cycle{c}.json", _step_events(pid=100 + c)) for c in (1, 2)],
            r"the traces of rank 0 were written by different processes \(trace_rank0_cycle1\.json: process 101; "
            r"trace_rank0_cycle2\.json: process 102\)",
        ),
    ],
    ids=["world-sizes", "hours-apart", "two-processes"],
)
def test_traces_of_different_runs_are_refused(tmp_path, capsys, setup, message):
    """They were merged into one report as if one run had made them."""
    setup(tmp_path)
    with pytest.raises(report.TraceError, match=message):
        report.load_traces(str(tmp_path))
    assert report.main([str(tmp_path), "--no-png"]) == 2
    assert "keep one run's files in the folder" in capsys.readouterr().err


def test_ranks_of_one_run_a_little_apart_are_one_run(tmp_path):
    for rank in (0, 1):  # 30 s apart: ranks that start profiling at different moments of one run
        _write(
            tmp_path,
            f"trace_rank{rank}.json",
            _step_events(),
            base_ns=1_790_000_000_000_000_000 + rank * 30_000_000_000,
        )
    assert [t.rank for t in report.load_traces(str(tmp_path))] == [0, 1]


def _torch_like_events(steps, pid=7, tid=7):
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 0.5,
            "dur": 1e6,
        },
    ]
    ts = 1.0
    for step in range(steps):
        events.append(_x(f"ProfilerStep#{step}", ts, 900.25, "user_annotation", pid, tid))
        events.append(_x("hasten.forward", ts + 1, 400.5, "user_annotation", pid, tid))
        for i in range(30):
            events.append(
                {
                    **_x("aten::linear" if i % 2 else "aten::relu", ts + 2 + i * 12.125, 11.0625, pid=pid, tid=tid),
                    "args": {"External id": step * 100 + i, "Input Dims": [[8, 16], [16]], "name": 'x\u00e9"y'},
                }
            )
            events.append(_x("aten::empty", ts + 3 + i * 12.125, 1.5, pid=pid, tid=tid))
        events.append({"ph": "s", "id": step, "pid": pid, "tid": tid, "ts": ts, "cat": "ac2g", "name": "launch"})
        events.append(
            {"ph": "f", "id": step, "pid": pid, "tid": tid, "ts": ts + 2, "cat": "ac2g", "name": "launch", "bp": "e"}
        )
        ts += 1000
    return events


def test_streaming_reader_agrees_with_json_load_across_chunk_boundaries(tmp_path, monkeypatch):
    """Tiny chunks split numbers, strings, escapes and keys everywhere: the result must not change."""
    for rank in (0, 1):
        data = {
            "schemaVersion": 1,
            "baseTimeNanoseconds": 1_000 + rank,
            "traceEvents": _torch_like_events(3, pid=7 + rank),
            "distributedInfo": {"rank": rank, "world_size": 2},
            "traceName": "t",
        }
        (tmp_path / f"trace_rank{rank}.json").write_text(json.dumps(data, indent=2))
    expected = report.merge_traces(report.load_traces(str(tmp_path)))
    direct = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    import hasten.report.traces as traces_module

    reads = []
    real_more = traces_module._JsonStream._more
    monkeypatch.setattr(traces_module._JsonStream, "_more", lambda self, *a: reads.append(1) or real_more(self, *a))
    counts = []
    for chunk in (1, 7, 64):
        monkeypatch.setattr(traces_module, "_CHUNK_CHARS", chunk)
        reads.clear()
        traces = report.load_traces(str(tmp_path))
        counts.append(len(reads))
        assert report.merge_traces(traces) == expected
        summary = report.analyse(traces)[0]
        assert {k: (s.calls, s.self_us) for k, s in summary.ops.items()} == {
            k: (s.calls, s.self_us) for k, s in report.self_times(direct).items()
        }
    assert counts[0] > counts[1] > counts[2] > 10  # the chunk size really applied: smaller chunks, more reads
    # The merged trace holds every original event but the process rows it renames, once.
    originals = [e for e in direct if not (e.get("ph") == "M" and e["name"] in report._PROCESS_META)]
    assert len(
        [e for e in expected["traceEvents"] if not (e.get("ph") == "M" and e["name"] in report._PROCESS_META)]
    ) == 2 * len(originals)


def test_a_multi_megabyte_trace_streams_in_chunks(tmp_path, capsys):
    data = {"baseTimeNanoseconds": 5, "traceEvents": _torch_like_events(400)}
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps(data, indent=2))
    assert path.stat().st_size > 4 * report._CHUNK_CHARS  # several chunks
    traces = report.load_traces(str(tmp_path))
    assert traces[0].files[0].events == len(data["traceEvents"])
    ops = report.analyse(traces)[0].ops
    assert ops["aten::relu"].calls == ops["aten::linear"].calls == 400 * 15 and ops["aten::empty"].calls == 400 * 30
    assert ops["aten::relu"].self_us == pytest.approx(400 * 15 * (11.0625 - 1.5))
    assert report.main([str(tmp_path), "--no-png"]) == 0
    merged = json.loads((tmp_path / report.MERGED_NAME).read_text())
    assert len(merged["traceEvents"]) == len(data["traceEvents"]) - 2 + 4  # 2 process rows renamed; 2 rows x 2 meta
    assert "Top 10 operators" in capsys.readouterr().out
