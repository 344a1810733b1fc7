"""Unit tests of the kwargs handlers: defaults, to_dict/to_kwargs, validation, translations."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch

from hasten import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)


# ------------------------------------------------------------------ KwargsHandler
def test_to_kwargs_only_differences():
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(cache_enabled=False).to_kwargs() == {"cache_enabled": False}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=10).to_kwargs() == {
        "init_scale": 1024.0,
        "growth_interval": 10,
    }
    assert set(GradScalerKwargs().to_dict()) == {
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
    }


def test_user_subclass_works():
    @dataclasses.dataclass
    class MyHandler(KwargsHandler):
        a: int = 1
        b: str = "x"

    assert MyHandler(a=2).to_kwargs() == {"a": 2}
    assert MyHandler().to_dict() == {"a": 1, "b": "x"}


def test_utils_reexports():
    from hasten import utils

    for name in (
        "AutocastKwargs",
        "DistributedDataParallelKwargs",
        "ProfileKwargs",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "KwargsHandler",
        "DDPCommunicationHookType",
    ):
        assert getattr(utils, name) is getattr(__import__("hasten"), name)


# ------------------------------------------------------------------ hook type
def test_hook_type_is_a_str_enum():
    assert "fp16" in DDPCommunicationHookType
    assert "power_sgd" in DDPCommunicationHookType
    assert "fp8" not in DDPCommunicationHookType
    assert str(DDPCommunicationHookType.BF16) == "bf16"
    assert DDPCommunicationHookType.FP16 == "fp16"
    assert [m.value for m in DDPCommunicationHookType] == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]


# ------------------------------------------------------------------ DDP
def test_ddp_defaults_and_to_kwargs():
    h = DistributedDataParallelKwargs()
    assert h.to_kwargs() == {}
    assert h.comm_hook is DDPCommunicationHookType.NO and h.comm_state_option == {}
    h = DistributedDataParallelKwargs(bucket_cap_mb=50, comm_hook="fp16", comm_wrapper="bf16")
    assert h.to_kwargs() == {"bucket_cap_mb": 50}  # comm_* are not DDP arguments
    assert h.comm_hook is DDPCommunicationHookType.FP16 and h.comm_wrapper is DDPCommunicationHookType.BF16
    assert DistributedDataParallelKwargs(static_graph=True).constructor_kwargs() == {
        "dim": 0,
        "bucket_cap_mb": 25,
        "find_unused_parameters": False,
        "check_reduction": False,
        "gradient_as_bucket_view": False,
        "static_graph": True,
    }
    assert DistributedDataParallelKwargs(broadcast_buffers=False).constructor_kwargs()["broadcast_buffers"] is False


def test_ddp_power_sgd_options():
    h = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 2})
    assert h.comm_state_option == {"matrix_approximation_rank": 2}
    with pytest.raises(ValueError, match="unknown key 'rank'.*matrix_approximation_rank"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option={"rank": 2})
    with pytest.raises(ValueError, match="only used by the PowerSGD hooks.*comm_hook='fp16'"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_state_option={"matrix_approximation_rank": 2})
    with pytest.raises(TypeError, match=r"comm_state_option\['warm_start'\] must be of type bool"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option={"warm_start": 1})
    with pytest.raises(ValueError, match="matrix_approximation_rank'\\] must be >= 1"):
        DistributedDataParallelKwargs(comm_hook="batched_power_sgd", comm_state_option={"matrix_approximation_rank": 0})


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"dim": -1}, ValueError, "dim must be >= 0, got -1"),
        ({"dim": 1.5}, TypeError, "dim must be an integer"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0, got 0"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb must be a number"),
        ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be True or False"),
        ({"broadcast_buffers": 1}, TypeError, "broadcast_buffers must be True or False"),
        ({"static_graph": None}, TypeError, "static_graph"),
        (
            {"comm_hook": "fp8"},
            ValueError,
            "comm_hook must be one of 'no', 'fp16', 'bf16', 'power_sgd', 'batched_power_sgd', got 'fp8'",
        ),
        (
            {"comm_wrapper": "power_sgd"},
            ValueError,
            "comm_wrapper must be one of 'no', 'fp16', 'bf16', got 'power_sgd'",
        ),
        ({"comm_hook": 3}, TypeError, "comm_hook must be one of"),
        ({"comm_state_option": [1]}, TypeError, "comm_state_option must be a dict"),
    ],
)
def test_ddp_bad_values(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        DistributedDataParallelKwargs(**kwargs)


# ------------------------------------------------------------------ autocast / scaler
def test_autocast_validation_and_kwargs():
    assert AutocastKwargs(cache_enabled=False).autocast_kwargs("cpu", torch.bfloat16) == {
        "device_type": "cpu",
        "dtype": torch.bfloat16,
        "enabled": True,
        "cache_enabled": False,
    }
    assert "cache_enabled" not in AutocastKwargs().autocast_kwargs("cpu", torch.float16)
    with pytest.raises(TypeError, match="AutocastKwargs.enabled must be True or False, got 'yes'"):
        AutocastKwargs(enabled="yes")
    with pytest.raises(TypeError, match="cache_enabled must be True, False or None"):
        AutocastKwargs(cache_enabled=0)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"init_scale": 0}, ValueError, "init_scale must be > 0, got 0"),
        ({"init_scale": -1.0}, ValueError, "init_scale must be > 0"),
        ({"init_scale": float("inf")}, ValueError, "init_scale must be a finite number"),
        ({"init_scale": "big"}, TypeError, "init_scale must be a number"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be > 1, got 1.0"),
        # Factors that round to 1.0 in float32 (the scale's dtype) passed before and never changed the scale.
        (
            {"growth_factor": 1.00000001},
            ValueError,
            r"growth_factor must be > 1 in float32 .*1.0000001192092896\), got 1.00000001, which is 1.0 in float32",
        ),
        ({"growth_factor": 1e39}, ValueError, r"growth_factor must be <= 3.4028234663852886e\+38, got 1e\+39"),
        (
            {"backoff_factor": 0.99999999},
            ValueError,
            r"backoff_factor must be < 1 in float32 .*0.9999999403953552\), got 0.99999999, which is 1.0 in float32",
        ),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be > 0 and < 1, got 1.0"),
        ({"backoff_factor": 0}, ValueError, "backoff_factor must be > 0 and < 1"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1, got 0"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an integer"),
        ({"growth_interval": True}, TypeError, "growth_interval must be an integer"),
        ({"enabled": "no"}, TypeError, "enabled must be True or False"),
    ],
)
def test_scaler_bad_values(kwargs, error, words):
    with pytest.raises(error, match="GradScalerKwargs." + words):
        GradScalerKwargs(**kwargs)


def test_scaler_builds_on_cpu():
    scaler = GradScalerKwargs(init_scale=8.0, growth_interval=3).build("cpu")
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == 8.0 and scaler.get_growth_interval() == 3


# ------------------------------------------------------------------ profile
def test_profile_validation():
    h = ProfileKwargs(activities=["CPU"], schedule_option={"wait": 1, "warmup": 1, "active": 2})
    assert h.activities == ["cpu"]
    assert isinstance(h.build(), torch.profiler.profile)
    for kwargs, error, words in [
        (
            {"activities": ["gpu"]},
            ValueError,
            "activities must be one of 'cpu', 'cuda', 'xpu', 'mtia', 'hpu', got 'gpu'",
        ),
        ({"activities": "cpu"}, TypeError, "activities must be a list"),
        ({"activities": []}, ValueError, "at least one"),
        ({"schedule_option": {"wait": 1}}, ValueError, "needs an 'active' count"),
        ({"schedule_option": {"active": 0}}, ValueError, "must be >= 1, got 0"),
        ({"schedule_option": {"active": 1, "wait": -1}}, ValueError, "must be >= 0, got -1"),
        ({"schedule_option": {"active": 1, "warm": 1}}, ValueError, "unknown key 'warm'.*'warmup'"),
        ({"schedule_option": [1]}, TypeError, "schedule_option must be a dict"),
        ({"on_trace_ready": "print"}, TypeError, "on_trace_ready must be a callable"),
        ({"record_shapes": 1}, TypeError, "record_shapes must be True or False"),
        ({"with_flops": None}, TypeError, "with_flops"),
        ({"output_trace_dir": 3}, TypeError, "output_trace_dir must be a path"),
        ({"output_trace_dir": ""}, ValueError, "non-empty path"),
    ]:
        with pytest.raises(error, match=words):
            ProfileKwargs(**kwargs)


def test_profile_schedule_needs_only_active():
    calls = []
    with ProfileKwargs(
        schedule_option={"active": 2}, on_trace_ready=lambda p: calls.append(p.step_num)
    ).build() as prof:
        for _ in range(3):
            prof.step()
    assert calls[0] == 2  # the first cycle (no wait, no warmup) completes after two steps


def test_profile_build_runs_schedule():
    calls = []
    h = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 1, "warmup": 0, "active": 1, "repeat": 2},
        on_trace_ready=lambda p: calls.append(p.step_num),
    )
    with h.build() as prof:
        for _ in range(6):
            torch.ones(4) @ torch.ones(4)
            prof.step()
    assert len(calls) == 2


# ------------------------------------------------------------------ process group
def test_process_group_timeouts():
    assert InitProcessGroupKwargs().timeout == timedelta(seconds=600)
    assert InitProcessGroupKwargs(backend="gloo").timeout == timedelta(seconds=1800)
    assert InitProcessGroupKwargs(backend="gloo").to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=1800)}
    assert InitProcessGroupKwargs().to_kwargs() == {}
    # A written timeout is kept even when it equals the default.
    assert InitProcessGroupKwargs(timeout=timedelta(seconds=600)).to_kwargs() == {"timeout": timedelta(seconds=600)}
    assert InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=1800)).to_kwargs()["timeout"] == timedelta(
        seconds=1800
    )


def test_process_group_choose_for_me():
    auto = InitProcessGroupKwargs()
    assert auto.backend == "nccl" and auto.backend_is_auto and auto.timeout_is_auto
    assert auto.process_group_kwargs("cpu") == {"backend": "gloo", "timeout": timedelta(seconds=1800)}
    assert auto.process_group_kwargs("cuda") == {"backend": "nccl", "timeout": timedelta(seconds=600)}
    written = InitProcessGroupKwargs(timeout=timedelta(seconds=42), init_method="tcp://127.0.0.1:1234")
    assert written.process_group_kwargs("cpu") == {
        "backend": "gloo",
        "timeout": timedelta(seconds=42),
        "init_method": "tcp://127.0.0.1:1234",
    }
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA.*use backend='gloo'"):
        InitProcessGroupKwargs(backend="nccl").process_group_kwargs("cpu")
    assert (
        repr(auto)
        == "InitProcessGroupKwargs(backend='nccl', init_method=None, timeout=datetime.timedelta(seconds=600))"
    )


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"backend": "glue"}, ValueError, "backend must be one of .*'gloo'.*got 'glue'"),
        ({"backend": 5}, TypeError, "backend must be a backend name"),
        ({"init_method": 5}, TypeError, "init_method must be a URL string"),
        ({"timeout": 30}, TypeError, r"timeout must be a datetime.timedelta .*got 30 \(int\)"),
        ({"timeout": timedelta(0)}, ValueError, "timeout must be a positive timedelta"),
        ({"timeout": timedelta(seconds=-5)}, ValueError, "timeout must be a positive"),
        (
            {"timeout": timedelta(microseconds=500)},
            ValueError,
            r"timeout must be at least datetime.timedelta\(microseconds=1000\) \(1 ms.*got "
            r"datetime.timedelta\(microseconds=500\)",
        ),
        ({"timeout": timedelta.max}, ValueError, r"timeout must be at most datetime.timedelta\(days=36500\)"),
    ],
)
def test_process_group_bad_values(kwargs, error, words):
    with pytest.raises(error, match="InitProcessGroupKwargs." + words):
        InitProcessGroupKwargs(**kwargs)


def test_scaler_factors_next_to_one_in_float32_are_accepted_and_change_the_scale():
    import torch

    above, below = 1 + 2.0**-23, 1 - 2.0**-24
    kwargs = GradScalerKwargs(init_scale=1.0, growth_factor=above, backoff_factor=below)
    assert torch.tensor(above, dtype=torch.float32) > 1 and torch.tensor(below, dtype=torch.float32) < 1
    assert kwargs.growth_factor == above and kwargs.backoff_factor == below
