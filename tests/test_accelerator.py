"""Single-process tests of the Accelerator: construction, precision, prepare, the step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from hasten import (
    Accelerator,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    PartialState,
    ProfileKwargs,
)
from hasten.data_loader.core import ShardedBatchSampler


class DtypeProbe(torch.nn.Module):
    """Records the dtype of its matmul result."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        out = self.lin(x)
        self.seen = out.dtype
        return out


# ------------------------------------------------------------------ construction
def test_handlers_sorted_by_isinstance():
    class MyDDP(DistributedDataParallelKwargs):
        pass

    acc = Accelerator(kwargs_handlers=[MyDDP(bucket_cap_mb=5), GradScalerKwargs(init_scale=4.0)])
    assert isinstance(acc.ddp_handler, MyDDP) and acc.scaler_handler.init_scale == 4.0
    with pytest.raises(ValueError, match="two GradScalerKwargs"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)])
    with pytest.raises(TypeError, match="kwargs_handlers got .*dict.*allowed: AutocastKwargs"):
        Accelerator(kwargs_handlers=[{"bucket_cap_mb": 5}])
    with pytest.raises(TypeError, match="kwargs_handlers must be a list"):
        Accelerator(kwargs_handlers=GradScalerKwargs())


def test_misspelt_keyword_names_the_right_one():
    with pytest.raises(TypeError, match="'kwargs_handler'; did you mean 'kwargs_handlers'"):
        Accelerator(kwargs_handler=[GradScalerKwargs()])
    with pytest.raises(TypeError, match="'mixed_precison'; did you mean 'mixed_precision'"):
        Accelerator(mixed_precison="bf16")


def test_bad_arguments():
    with pytest.raises(ValueError, match="mixed_precision must be one of 'no', 'fp16', 'bf16', 'fp8', got 'fp4'"):
        Accelerator(mixed_precision="fp4")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be >= 1, got 0"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="Accelerator.cpu must be True or False"):
        Accelerator(cpu="yes")


def test_prepare_returns_what_it_does_not_prepare_unchanged():
    # As Accelerate: None silently (an optional scheduler), anything else with a one-line warning.
    acc = Accelerator()
    model, other = torch.nn.Linear(2, 2), {"not": "a model"}
    with pytest.warns(UserWarning, match="prepare\\(\\) returns dict unchanged"):
        m, none, same = acc.prepare(model, None, other)
    assert none is None and same is other and m is not None and len(acc._models) == 1
    quantized = torch.nn.Linear(2, 2)
    quantized.is_loaded_in_4bit, quantized.hf_device_map = True, {"": "disk"}
    with pytest.raises(ValueError, match="8-bit or 4-bit precision with CPU or disk offload"):
        acc.prepare(torch.nn.Linear(2, 2), quantized)
    assert len(acc._models) == 1  # refused before the first model was prepared


def test_settings_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("HASTEN_GRADIENT_ACCUMULATION_STEPS", "4")
    acc = Accelerator()
    assert acc.mixed_precision == "bf16" and acc.gradient_accumulation_steps == 4
    with pytest.warns(UserWarning, match="mixed_precision='no'.*overrides HASTEN_MIXED_PRECISION='bf16'"):
        acc = Accelerator(mixed_precision="no")
    assert acc.mixed_precision == "no"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(mixed_precision="bf16")  # agreeing: no warning
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "fp64")
    expected = "HASTEN_MIXED_PRECISION must be one of 'no', 'fp16', 'bf16', 'fp8', got 'fp64'"
    with pytest.raises(ValueError, match=expected):
        Accelerator()


def test_several_accelerators_coexist():
    a, b, c = Accelerator(mixed_precision="bf16"), Accelerator(mixed_precision="fp16"), Accelerator()
    assert (a.mixed_precision, b.mixed_precision, c.mixed_precision) == ("bf16", "fp16", "no")
    assert a.scaler is None and isinstance(b.scaler, torch.amp.GradScaler) and c.scaler is None
    ma, mb, mc = (acc.prepare(DtypeProbe()) for acc in (a, b, c))
    x = torch.randn(2, 4)
    for model, dtype in ((ma, torch.bfloat16), (mb, torch.float16), (mc, torch.float32)):
        assert model(x).dtype == torch.float32  # outputs come back in float32
        assert model.seen == dtype


def test_process_facts_single_process():
    acc = Accelerator()
    assert (acc.num_processes, acc.process_index, acc.local_process_index) == (1, 0, 0)
    assert acc.is_main_process and acc.is_local_main_process and str(acc.distributed_type) == "NO"
    assert acc.device == torch.device("cpu")
    state = PartialState()
    assert state.num_processes == 1 and not state.use_distributed


def test_nccl_without_cuda_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is allowed")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="needs CUDA devices.*use backend='gloo'"):
        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")])


def test_distributed_env_without_master_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT is not set.*hasten launch"):
        PartialState()


# ------------------------------------------------------------------ precision
def test_precision_off_keeps_the_models_own_forward():
    acc = Accelerator()
    model = DtypeProbe()
    prepared = acc.prepare(model)
    assert prepared is model
    assert "forward" not in vars(prepared)  # no wrapper: the class's forward runs
    assert acc.unwrap_model(prepared) is model


def test_unwrap_model_can_drop_the_autocast_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(DtypeProbe())
    assert "forward" in vars(model)
    acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in vars(model)
    model(torch.randn(1, 4))
    assert model.seen == torch.float32


def test_autocast_context_nests_and_takes_a_handler():
    acc = Accelerator(mixed_precision="bf16")
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with acc.autocast():
        assert (a @ b).dtype == torch.bfloat16
        with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
            assert (a @ b).dtype == torch.float32
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32
    with Accelerator().autocast():  # precision off: nothing changes
        assert (a @ b).dtype == torch.float32
    off = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = off.prepare(DtypeProbe())
    model(torch.randn(1, 4))
    assert model.seen == torch.float32
    with pytest.raises(TypeError, match="autocast_handler must be an AutocastKwargs"):
        acc.autocast(autocast_handler=GradScalerKwargs())


def _fp16_setup(init_scale=1024.0):
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=init_scale)])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def test_fp16_on_cpu_scales_the_loss_and_steps():
    acc, model, opt, sched = _fp16_setup()
    assert acc.scaler.get_scale() == 1024.0
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(acc.unwrap_model(model).state_dict())
    torch.nn.functional.mse_loss(reference(x), y).backward()
    before = model.weight.detach().clone()
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    # gradients are scaled by the loss scale (fp16 rounding: loose tolerance)
    torch.testing.assert_close(model.weight.grad / 1024.0, reference.weight.grad, rtol=2e-2, atol=1e-3)
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert not torch.equal(model.weight.detach(), before)  # weights move
    assert sched.get_last_lr() == [0.05]


def test_fp16_skips_the_step_on_inf_and_scheduler_waits():
    acc, model, opt, sched = _fp16_setup()
    before = model.weight.detach().clone()
    loss = model(torch.randn(2, 4)).sum() * float("inf")
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped
    assert torch.equal(model.weight.detach(), before)
    assert acc.scaler.get_scale() == 512.0  # backed off
    assert sched.get_last_lr() == [0.1]  # no real step, no scheduler step


def test_scaler_disabled_means_no_scaler():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(enabled=False)])
    assert acc.scaler is None


# ------------------------------------------------------------------ data
def test_single_process_loader_yields_everything_in_a_reproducible_order():
    ds = TensorDataset(torch.arange(10).float())
    orders = []
    for _ in range(2):
        torch.manual_seed(3)
        acc = Accelerator()
        loader = acc.prepare(DataLoader(ds, batch_size=4, shuffle=True))
        assert len(loader) == 3
        epochs = [[int(v) for (b,) in loader for v in b] for _ in range(2)]
        assert all(sorted(e) == list(range(10)) for e in epochs)
        assert epochs[0] != epochs[1]  # a new order each epoch
        orders.append(epochs)
    assert orders[0] == orders[1]  # same seed, same orders


def _shards(n_samples, batch_size, n, split=False, drop_last=False, even=True):
    shards = []
    for rank in range(n):
        base = BatchSampler(SequentialSampler(range(n_samples)), batch_size, drop_last)
        s = ShardedBatchSampler(base, n, rank, split_batches=split, even_batches=even)
        batches = list(s)
        assert len(batches) == len(s)
        shards.append((batches, s.duplicates))
    return shards


@pytest.mark.parametrize("n_samples, batch_size, n", [(10, 4, 2), (16, 4, 2), (7, 2, 3), (5, 4, 2), (13, 3, 4)])
def test_sharding_even_batches(n_samples, batch_size, n):
    shards = _shards(n_samples, batch_size, n)
    counts = {len(b) for b, _ in shards}
    assert len(counts) == 1  # every rank gets as many batches
    assert all(len(batch) == batch_size for b, _ in shards for batch in b)  # of the same size
    seen = [i for b, _ in shards for batch in b for i in batch]
    assert set(seen) == set(range(n_samples))
    assert len(seen) - n_samples == shards[0][1]  # duplicates counted


def test_sharding_split_batches_and_drop_last():
    shards = _shards(16, 8, 2, split=True)
    assert [b for b, _ in shards] == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    with pytest.raises(ValueError, match="batch_size divisible by the number of processes.*batch_size=7"):
        _shards(14, 7, 2, split=True)
    dropped = _shards(10, 4, 2, drop_last=True)
    assert [b for b, _ in dropped] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    uneven = _shards(10, 4, 2, even=False)
    assert [len(b) for b, _ in uneven] == [2, 1]
    # split, not evened, last batch of 1 sample for 2 ranks: rank 1 has one batch fewer (len says so)
    split_uneven = _shards(9, 4, 2, split=True, even=False)
    assert [len(b) for b, _ in split_uneven] == [3, 2]


def test_profile_uses_the_handler(tmp_path):
    acc = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))])
    with acc.profile() as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert isinstance(prof, torch.profiler.profile)
    assert list(tmp_path.iterdir()), "a trace was written"


def test_accelerate_only_arguments_that_ask_for_nothing_are_accepted():
    """An Accelerate script passing these as 'off' runs; asking for the feature is a clear error."""
    accelerator = Accelerator(cpu=True, deepspeed_plugin=None, fsdp_plugin=None, dynamo_backend="no", rng_types=None)
    assert accelerator.num_processes >= 1
    with pytest.raises(
        TypeError, match=r"Accelerator\(deepspeed_plugin='zero3'\) is Accelerate's argument for DeepSpeed"
    ):
        Accelerator(cpu=True, deepspeed_plugin="zero3")
    with pytest.raises(
        TypeError, match=r"Accelerator.fsdp_plugin must be a FullyShardedDataParallelPlugin or None, got 'full'"
    ):
        Accelerator(cpu=True, fsdp_plugin="full")


def test_fp16_on_the_cpu_warns_that_bf16_is_faster():
    """A first run with fp16 on a CPU is many times slower than bf16 (torch's float16 CPU
    kernels): said once, where it is asked for; bf16 says nothing."""
    with pytest.warns(UserWarning, match="mixed_precision='fp16' on the CPU is much slower than 'bf16'"):
        Accelerator(cpu=True, mixed_precision="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(cpu=True, mixed_precision="bf16")


def test_the_state_carries_the_fsdp_plugin_as_in_accelerate():
    """Accelerate's scripts read ``accelerator.state.fsdp_plugin`` (e.g. its fsdp_utils callers)."""
    from hasten import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert Accelerator(cpu=True, fsdp_plugin=plugin).state.fsdp_plugin is plugin
    assert Accelerator(cpu=True).state.fsdp_plugin is None
