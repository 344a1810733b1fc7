"""The fifth reliability round (issue 48) for pipeline and tensor parallelism: one 2-process and one
4-process launch of scripts/round5_checks.py (the same order on every process of a data group
whatever each seeded, PP + fp8 with the optimizer built first, a bounded schedule cache, dict
targets, a stage without parameters, dispatch_batches refused by name), and in-process checks
(fp8 that converts nothing says why, the optimizer rebinding after fp8 and a split, the DDP seams)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from conftest import SCRIPTS
from launch_utils import free_port, launch


def _launch(tmp_path_factory, mode, processes):
    out = tmp_path_factory.mktemp(mode)
    proc = launch(
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        SCRIPTS / "round5_checks.py",
        str(out),
        mode,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(tmp_path_factory, "two", 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, "four", 4)


def _ok(entry):
    assert "error" not in entry, entry.get("error")
    return entry


def _order(epochs):
    return [[batch[:4] for batch in epoch] for epoch in epochs]  # the sample indices of each batch


@pytest.mark.parametrize("case", ["orders_pp2", "orders_tp2"])
def test_one_data_group_reads_one_order_whatever_each_process_seeded(two, case):
    """PP 2 or TP 2 alone (one data group), a shuffled loader, no set_seed: both processes read the
    same samples in the same order, epoch after epoch; with workers, their random numbers (the
    workers' base seed) agree too, shuffled or not."""
    a, b = (_ok(r[case]) for r in two)
    assert _order(a["workers0"]) == _order(b["workers0"])
    assert _order(a["workers0"])[0] != _order(a["workers0"])[1]  # shuffled again each epoch
    assert sorted(i for batch in _order(a["workers0"])[0] for i in batch) == list(range(32))
    assert a["workers2"] == b["workers2"]  # indices and the workers' random numbers
    assert a["sequential_workers"] == b["sequential_workers"]


def test_two_data_ranks_still_read_disjoint_shares(two):
    a, b = (_ok(r["orders_ddp2"]) for r in two)
    first_a = {i for batch in _order(a["workers0"])[0] for i in batch}
    first_b = {i for batch in _order(b["workers0"])[0] for i in batch}
    assert not first_a & first_b and len(first_a | first_b) == 32


@pytest.mark.parametrize("case, groups", [("orders_pp2_dp2", [(0, 2), (1, 3)]), ("orders_tp2_dp2", [(0, 1), (2, 3)])])
def test_each_data_group_reads_one_order_on_four_processes(four, case, groups):
    entries = [_ok(r[case]) for r in four]
    shares = []
    for i, j in groups:  # the processes of one data group
        assert _order(entries[i]["workers0"]) == _order(entries[j]["workers0"])
        assert entries[i]["workers2"] == entries[j]["workers2"]
        shares.append({k for batch in _order(entries[i]["workers0"])[0] for k in batch})
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 32  # the data ranks: disjoint


def test_pp_x_tp_with_fp8_trains_close_to_fp32(four):
    """The float8 scales are precomputed per mesh (torchao's one stack refuses TP-split weights
    beside unsplit ones)."""
    for rank in four:
        r = _ok(rank["pp2_tp2_fp8"])
        assert r["fp8_float8_layers"] > 0 and r["no_float8_layers"] == 0
        torch.testing.assert_close(r["fp8"], r["no"], rtol=0, atol=5e-2)


def test_pp_with_fp8_and_the_optimizer_built_first_holds_only_its_stage_and_saves(two):
    for rank in two:
        r = _ok(rank["fp8_optimizer_before_prepare"])
        assert r["foreign"] == 0 and r["optimizer_params"] == r["stage_params"] > 0
        assert r["float8_layers"] > 0
        assert r["reloaded_same"]
    assert two[0]["fp8_optimizer_before_prepare"]["losses"] == two[1]["fp8_optimizer_before_prepare"]["losses"]


def test_the_schedule_cache_is_bounded_and_every_shape_still_right(two):
    for rank in two:
        r = _ok(rank["schedule_cache"])
        assert r["steps"] > r["limit"] and r["kept"] == r["limit"]
        assert r["max_diff"] < 1e-5


def test_dict_targets_train_as_one_process_and_bad_ones_are_refused(two):
    for rank in two:
        r = _ok(rank["dict_targets"])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=0, atol=1e-5)
        assert "pipeline_step.targets must be a tensor" in r["refused"]["short"] and "(3, 3)" in r["refused"]["short"]
        assert "holding no tensor" in r["refused"]["empty"]


def test_a_stage_without_parameters_saves_and_loads(two):
    entries = [_ok(r["zero_param_stage"]) for r in two]
    assert [e["stage_params"] for e in entries] == [2, 0]
    assert all(e["saved"] for e in entries)


def test_dispatch_batches_with_pp_names_pp(two):
    message = _ok(two[0]["dispatch_refused"])["message"]
    assert "ParallelismConfig(pp_size=2)" in message and "tp_size" not in message


# ---------------------------------------------------------------------- in process
class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 10)
        self.c = nn.Linear(10, 16)
        self.d = nn.Linear(16, 16)


def test_fp8_that_converts_nothing_says_why():
    pytest.importorskip("torchao")
    from hasten.training import float8
    from hasten.training.float8 import Float8Plan, linear_config

    plan = Float8Plan(linear_config(True, False))
    with pytest.warns(UserWarning, match=r"converted no layer of _Odd to float8: of its 4 nn.Linear layer\(s\), 2 are"):
        assert float8.apply_float8(_Odd(), plan) == []
    with pytest.warns(UserWarning, match="module_filter_func refused all of its 4"):
        float8.apply_float8(_Odd(), Float8Plan(linear_config(True, False), lambda m, n: False))
    with pytest.warns(UserWarning, match="it has no torch.nn.Linear layer"):
        float8.apply_float8(nn.Sequential(nn.ReLU()), plan)
    wide = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with layers to convert: nothing said
        float8.apply_float8(wide, plan)
    assert type(wide[1]).__name__ == "Float8Linear"


def test_rebind_drops_a_replacement_of_a_dropped_stage():
    """fp8 replaces a parameter, then the pipeline split drops the replacement: an optimizer built
    before prepare loses it (it kept the other stage's float8 weights)."""
    from hasten.strategies.parallelize import ParamSwaps

    kept, gone = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    kept8, gone8 = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([kept, gone], lr=0.1)
    swaps = ParamSwaps()
    swaps.record([(kept, kept8), (gone, gone8)])
    swaps.drop([gone8])
    swaps.rebind(opt)
    assert opt.param_groups[0]["params"] == [kept8]


def test_ddp_is_recognised_by_the_strategies_only():
    import pathlib

    src = pathlib.Path(__file__).parent.parent / "src" / "hasten" / "training"
    for name in ("compile.py", "throughput.py"):
        assert "DistributedDataParallel" not in (src / name).read_text(), name
    from hasten.strategies.base import is_collective_wrapper

    assert not is_collective_wrapper(nn.Linear(2, 2))
