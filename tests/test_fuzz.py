"""Property-based tests of the kwargs handlers and their config-file sections (hypothesis).

* Any valid handler survives a round trip through its config-file section: fields -> YAML
  file -> ``hasten.settings.config_file.handlers_from_file`` (the handlers' own constructors) -> an equal
  handler that means the same thing.
* ``to_kwargs()`` is always a subset of ``to_dict()``.
* Any value is either refused at construction with ValueError/TypeError, or accepted and then
  works: the handler's own translation builds its torch object and runs one step with it
  (a GradScaler step, an autocast region, a profiler, a DDP model's forward and backward).
  Never an AttributeError, and never an accepted value that fails later inside torch.
* A config file with random sections and values is refused with ValueError/TypeError or
  gives handlers that pass the same check.
"""

from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hasten.settings import config_file as config
from hasten.settings.choices import COMM_HOOKS, COMM_WRAPPERS, POWER_SGD_HOOKS, PROFILER_ACTIVITIES, SCHEDULE_KEYS
from hasten.settings.handlers import (
    FLOAT32_ABOVE_ONE,
    FLOAT32_BELOW_ONE,
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT64_MAX,
    MAX_TIMEOUT,
    POWER_SGD_OPTIONS,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from hasten.strategies.ddp import DDPPlan, apply_ddp

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SECTION_OF = {
    getattr(__import__("hasten.settings.handlers", fromlist=[c]), c): s for s, c in config.HANDLER_SECTIONS.items()
}


# ---------------------------------------------------------------------- valid handlers


def finite(low: float, high: float, **kw: Any) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, **kw)


def power_sgd_options() -> st.SearchStrategy[dict]:
    values = {
        "matrix_approximation_rank": st.integers(1, 8),
        "start_powerSGD_iter": st.integers(2, 10**6),
        "min_compression_rate": finite(0, 1e6),
        "use_error_feedback": st.booleans(),
        "warm_start": st.booleans(),
        "orthogonalization_epsilon": finite(0, 1e-3),
        "random_seed": st.integers(0, 2**32 - 1),
        "compression_stats_logging_frequency": st.integers(1, 10**6),
        "batch_tensors_with_same_shape": st.booleans(),
    }
    return st.fixed_dictionaries({}, optional=values)


@st.composite
def ddp_handlers(draw: Any) -> DistributedDataParallelKwargs:
    hook = draw(st.sampled_from(COMM_HOOKS))
    return DistributedDataParallelKwargs(
        dim=draw(st.integers(0, 2**70)),
        broadcast_buffers=draw(st.booleans()),
        bucket_cap_mb=draw(finite(0, 2**43, exclude_min=True, exclude_max=True) | st.integers(1, 10**6)),
        find_unused_parameters=draw(st.booleans()),
        check_reduction=draw(st.booleans()),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=draw(st.booleans()),
        comm_hook=hook,
        comm_wrapper=draw(st.sampled_from(COMM_WRAPPERS)),
        comm_state_option=draw(power_sgd_options()) if hook in POWER_SGD_HOOKS else {},
    )


@st.composite
def profile_handlers(draw: Any) -> ProfileKwargs:
    schedule = st.fixed_dictionaries(
        {"active": st.integers(1, 10**9)}, optional={k: st.integers(0, 10**9) for k in SCHEDULE_KEYS if k != "active"}
    )
    return ProfileKwargs(
        activities=draw(
            st.none() | st.lists(st.sampled_from(PROFILER_ACTIVITIES + ("CPU", "Cuda")), min_size=1, max_size=3)
        ),
        schedule_option=draw(st.none() | schedule),
        record_shapes=draw(st.booleans()),
        profile_memory=draw(st.booleans()),
        with_stack=draw(st.booleans()),
        with_flops=draw(st.booleans()),
        with_modules=draw(st.booleans()),
        output_trace_dir=draw(
            st.none()
            | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=20)
        ),
        step_with_optimizer=draw(st.booleans()),
    )


def timeouts() -> st.SearchStrategy[timedelta]:
    return st.timedeltas(min_value=timedelta(microseconds=1), max_value=MAX_TIMEOUT)


VALID = st.one_of(
    st.builds(AutocastKwargs, enabled=st.booleans(), cache_enabled=st.none() | st.booleans()),
    st.builds(
        GradScalerKwargs,
        init_scale=finite(FLOAT32_TINY, FLOAT32_MAX) | st.integers(1, 2**64),
        growth_factor=finite(FLOAT32_ABOVE_ONE, FLOAT32_MAX),  # > 1 and finite in float32
        backoff_factor=finite(FLOAT32_TINY, FLOAT32_BELOW_ONE),  # < 1 in float32
        growth_interval=st.integers(1, INT64_MAX),
        enabled=st.booleans(),
    ).filter(lambda h: h.init_scale <= FLOAT32_MAX),
    ddp_handlers(),
    profile_handlers(),
    st.builds(
        InitProcessGroupKwargs,
        backend=st.sampled_from([None, "gloo", "GLOO", "nccl", "cpu:gloo,cuda:nccl", "mpi"]),
        init_method=st.none() | st.sampled_from(["env://", "tcp://127.0.0.1:29500", "file:///tmp/x"]),
        timeout=st.none() | timeouts(),
    ),
)


# ---------------------------------------------------------------------- round trip through a config file


def _auto(handler: KwargsHandler, name: str) -> bool:
    """A value the user did not write (an InitProcessGroupKwargs default chosen by backend)."""
    return isinstance(handler, InitProcessGroupKwargs) and (
        (name == "backend" and handler.backend_is_auto) or (name == "timeout" and handler.timeout_is_auto)
    )


def _yaml_value(value: Any) -> Any:
    if isinstance(value, timedelta):
        return value.total_seconds()  # the config file writes timeouts in seconds
    if isinstance(value, str):
        return str(value)  # a str enum member: its plain value
    return value


def section(handler: KwargsHandler) -> dict[str, Any]:
    """The handler's config-file section: every field the user wrote (or left at a plain default)."""
    return {k: _yaml_value(v) for k, v in handler.to_dict().items() if not _auto(handler, k) and k != "on_trace_ready"}


def _meaning(handler: KwargsHandler) -> Any:
    if isinstance(handler, InitProcessGroupKwargs):
        return (handler.backend_is_auto, handler.timeout_is_auto, handler.process_group_kwargs("cuda"))
    return None


@FUZZ
@given(handler=VALID)
def test_a_valid_handler_survives_its_config_file_section(handler, tmp_path):
    name = SECTION_OF[type(handler)]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({name: section(handler)}), encoding="utf-8")
    loaded = config.handlers_from_file(path)
    assert len(loaded) == 1 and type(loaded[0]) is type(handler)
    assert loaded[0] == handler
    assert loaded[0].to_kwargs() == handler.to_kwargs()
    assert _meaning(loaded[0]) == _meaning(handler)


@FUZZ
@given(handler=VALID, trace=st.sampled_from([None, print]))
def test_to_kwargs_is_a_subset_of_to_dict(handler, trace):
    if isinstance(handler, ProfileKwargs):
        handler = dataclasses.replace(handler, on_trace_ready=trace)
    full, kwargs = handler.to_dict(), handler.to_kwargs()
    assert set(full) == {f.name for f in dataclasses.fields(handler)}
    for key, value in kwargs.items():
        assert key in full and full[key] == value, (key, value, full.get(key))


# ---------------------------------------------------------------------- any value: refused, or it works


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A 1-process gloo group for building DDP models (destroyed after this module)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def use(handler: KwargsHandler) -> None:
    """Build the torch object the handler configures and take one step with it."""
    if isinstance(handler, GradScalerKwargs):
        scaler = handler.build("cpu")
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scaler.scale(weight.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        if handler.enabled:
            assert 0 < scaler.get_scale() < math.inf  # a scale of 0 would skip every later step
    elif isinstance(handler, AutocastKwargs):
        with torch.autocast(**handler.autocast_kwargs("cpu", torch.bfloat16)):
            torch.ones(2, 2) @ torch.ones(2, 2)
    elif isinstance(handler, ProfileKwargs):
        with handler.build() as prof:
            torch.ones(2) + 1
            prof.step()
    elif isinstance(handler, InitProcessGroupKwargs):
        kwargs = (
            handler.process_group_kwargs("cpu") if "nccl" not in str(handler.backend) or handler.backend_is_auto else {}
        )
        for key in kwargs:
            assert key in ("backend", "timeout", "init_method"), key
        if kwargs:
            assert timedelta(0) < kwargs["timeout"] <= MAX_TIMEOUT and isinstance(kwargs["backend"], str)
    elif isinstance(handler, DistributedDataParallelKwargs):
        torch.manual_seed(0)
        model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), DDPPlan(handler))
        for _ in range(3):  # PowerSGD compresses from its start_powerSGD_iter-th step
            model(torch.randn(2, 4)).sum().backward()


NAMES = ["cpu", "CPU", "gloo", "nccl", "fp16", "bf16", "no", "power_sgd", "batched_power_sgd", "env://", "", "x"]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 3),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64]),
    st.floats(),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, 1e-320, 3.5e38, 1e308, math.inf, -math.inf, math.nan]),
    st.text(max_size=8),
    st.sampled_from(NAMES),
    st.binary(max_size=4),
    st.timedeltas(),
    st.just(object()),
    st.just(print),
)


def option_dicts(keys: tuple[str, ...]) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=5) | st.integers(), SCALARS, max_size=3)


ANY = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.tuples(SCALARS),
    option_dicts(tuple(POWER_SGD_OPTIONS)),
    option_dicts(SCHEDULE_KEYS),
)


HANDLERS = (AutocastKwargs, GradScalerKwargs, DistributedDataParallelKwargs, ProfileKwargs, InitProcessGroupKwargs)
FIELDS = [(cls, f.name) for cls in HANDLERS for f in dataclasses.fields(cls)]
DDP = DistributedDataParallelKwargs


@FUZZ
@given(target=st.sampled_from(FIELDS), value=ANY, hook=st.sampled_from(POWER_SGD_HOOKS + ("no",)))
@example(target=(GradScalerKwargs, "init_scale"), value=1e-320, hook="no")  # rounds to a float32 scale of 0
@example(target=(GradScalerKwargs, "init_scale"), value=3.5e38, hook="no")  # beyond float32
@example(target=(GradScalerKwargs, "backoff_factor"), value=1e-300, hook="no")  # a scale of 0 after one overflow
@example(target=(GradScalerKwargs, "growth_interval"), value=2**63, hook="no")  # beyond int64
@example(target=(DDP, "bucket_cap_mb"), value=2.0**43, hook="no")  # bytes beyond int64
@example(target=(DDP, "comm_state_option"), value={"start_powerSGD_iter": 1}, hook="power_sgd")
@example(target=(DDP, "comm_state_option"), value={"random_seed": 2**32}, hook="batched_power_sgd")
@example(target=(DDP, "comm_state_option"), value={"orthogonalization_epsilon": math.nan}, hook="power_sgd")
@example(target=(InitProcessGroupKwargs, "timeout"), value=timedelta.max, hook="no")
@example(target=(InitProcessGroupKwargs, "backend"), value="gloo,", hook="no")
@example(target=(ProfileKwargs, "activities"), value=("cpu",), hook="no")
def test_any_value_is_refused_or_works(target, value, hook, one_process_group):
    cls, name = target
    other = {"comm_hook": hook} if (cls is DDP and name == "comm_state_option") else {}
    try:
        handler = cls(**other, **{name: value})
    except (TypeError, ValueError):
        return
    use(handler)


@pytest.mark.parametrize(
    "handler",
    [
        GradScalerKwargs(init_scale=FLOAT32_MAX, growth_interval=INT64_MAX, growth_factor=FLOAT32_MAX),
        GradScalerKwargs(init_scale=FLOAT32_TINY, backoff_factor=FLOAT32_TINY),
        GradScalerKwargs(init_scale=FLOAT32_MAX, backoff_factor=FLOAT32_TINY),  # overflows, backs off to 4.0
        DistributedDataParallelKwargs(bucket_cap_mb=math.nextafter(2.0**43, 0), dim=2**70),
        DistributedDataParallelKwargs(
            comm_hook="power_sgd",
            comm_wrapper="bf16",
            comm_state_option={"start_powerSGD_iter": 2, "random_seed": 2**32 - 1, "matrix_approximation_rank": 2**40},
        ),  # fmt: skip
        DistributedDataParallelKwargs(
            comm_hook="batched_power_sgd",
            comm_state_option={"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False},
        ),
        ProfileKwargs(schedule_option={"active": 2**70, "wait": 2**70}, activities=["cpu"]),
        InitProcessGroupKwargs(timeout=MAX_TIMEOUT),
    ],
    ids=repr,
)
def test_the_largest_and_smallest_accepted_values_work(handler, one_process_group):
    use(handler)


def test_the_longest_accepted_timeout_initialises_a_process_group(tmp_path):
    """In a fresh interpreter (one process group per process): MAX_TIMEOUT reaches torch intact."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist\n"
        "from hasten.settings.handlers import InitProcessGroupKwargs, MAX_TIMEOUT\n"
        "kw = InitProcessGroupKwargs(backend='gloo', timeout=MAX_TIMEOUT).process_group_kwargs('cpu')\n"
        f"dist.init_process_group(store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, world_size=1, **kw)\n"
        "t = torch.ones(1); dist.all_reduce(t); dist.barrier(); print('OK', t.item())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout.strip() == "OK 1.0", proc.stderr[-3000:]


# ---------------------------------------------------------------------- random config files

YAML_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.sampled_from(NAMES),
    st.sampled_from([0, 1, -1, 0.5, 2**63, 1e39, 900]),
)  # fmt: skip
YAML_VALUES = st.one_of(
    YAML_SCALARS,
    st.lists(YAML_SCALARS, max_size=3),
    st.dictionaries(
        st.sampled_from((*POWER_SGD_OPTIONS, *SCHEDULE_KEYS)) | st.text(max_size=4), YAML_SCALARS, max_size=3
    ),
)


@st.composite
def config_documents(draw: Any) -> dict:
    doc: dict[Any, Any] = {}
    for name, cls_name in draw(
        st.lists(st.sampled_from(sorted(config.HANDLER_SECTIONS.items())), max_size=3, unique=True)
    ):
        cls = getattr(__import__("hasten.settings.handlers", fromlist=[cls_name]), cls_name)
        keys = [f.name for f in dataclasses.fields(cls)]
        doc[name] = draw(
            st.dictionaries(st.sampled_from(keys) | st.text(max_size=4), YAML_VALUES, max_size=3) | YAML_SCALARS
        )
    for key in draw(st.lists(st.sampled_from([*config.LAUNCH_SETTINGS, "num_proceses", 3]), max_size=2, unique=True)):
        doc[key] = draw(YAML_SCALARS)
    return doc


@FUZZ
@given(doc=config_documents())
def test_a_random_config_file_is_refused_or_gives_working_handlers(doc, tmp_path, one_process_group):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    try:
        handlers = config.handlers_from_file(path)
    except (TypeError, ValueError) as err:
        assert str(path) in str(err)  # the message says which file
        return
    for handler in handlers:
        use(handler)
