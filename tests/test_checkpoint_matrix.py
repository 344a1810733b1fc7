"""Every checkpoint shape loads at every shape, and back (issue 49), and ``load_state`` is all or
nothing.

The matrix: scripts/matrix_checks.py saves a tiny Llama at each shape of its ``SHAPES`` (1 process
plain, FSDP's "dcp" and "full" layouts on one process, fp8; DDP 2, FSDP 2 in both layouts, PP 2,
TP 2, FSDP 2 with fp8; FSDP 4, HSDP 2 x 2, TP 2 x FSDP 2, PP 2 x FSDP 2, PP 2 x TP 2 with fp8)
and loads each checkpoint at each shape. Four runs record every pair: the one-process saves and
loads here, in-process; a 2-process launch (saves, and loads of the 1- and 2-process
checkpoints); a 4-process launch (saves, loads of every checkpoint); a 2-process launch loading
the 4-process ones; the one-process loads of the 2- and 4-process ones in-process again. Each
pair is its own test: the loaded weights are exactly the saved ones, and the next two steps'
losses and the weights after them are the uninterrupted run's (to 1e-5 where the shapes sum in
another order; where fp8 is on one side only, or at two fp8 shapes, the numbers are fp8's own,
so only the weights are exact).
"""

from __future__ import annotations

import json
import math

import matrix_checks
import pytest
import torch
from pp_common import Llama, dataset, loss_fn

from conftest import SCRIPTS
from hasten import Accelerator
from launch_utils import free_port, launch

pytestmark = pytest.mark.filterwarnings("ignore:mixed_precision='fp8' on a CPU")
SHAPES = matrix_checks.SHAPES
TOL = 1e-5  # fp32 sums in another order (pipeline microbatches, tensor-parallel halves)
FP8_TOL = 2e-2  # fp8 at another shape quantises with other scales: the same trend, not the same numbers


def _size(shape: str) -> int:
    return SHAPES[shape][0]


def _launch(out, processes: int, save: bool, pairs: str, *sources) -> dict:
    proc = launch(
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        SCRIPTS / "matrix_checks.py",
        str(out),
        "1" if save else "0",
        pairs,
        *map(str, sources),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "rank0.json").read_text())  # the main process: it holds the whole weights


def _records(tmp_path_factory, subset: bool) -> dict:
    """Every pair's record, by ``"<saved>-><loaded>"``: one-process saves and loads here, a
    2-process launch, a 4-process one, (all pairs:) a 2-process one loading the 4-process
    checkpoints, and the one-process loads of the 2- and 4-process ones here."""
    pairs = "subset" if subset else "all"
    one, two, four = (tmp_path_factory.mktemp(n) for n in ("one", "two", "four"))
    records = matrix_checks.run(str(one), True, [], 1, subset)
    records |= _launch(two, 2, True, pairs, *([] if subset else [one]))
    records |= _launch(four, 4, True, pairs, *([] if subset else [one, two]))
    if not subset:
        records |= _launch(tmp_path_factory.mktemp("back"), 2, False, pairs, four)
    records |= matrix_checks.run(str(tmp_path_factory.mktemp("to_one")), False, [str(two), str(four)], 1, subset)
    return records


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    return _records(tmp_path_factory, subset=True)


@pytest.fixture(scope="module")
def every(tmp_path_factory) -> dict:
    return _records(tmp_path_factory, subset=False)


def _check(records: dict, saved: str, loaded: str) -> None:
    """The loaded weights are the saved ones exactly; the next two steps' losses and the weights
    after them are the uninterrupted run's (fp8 on one side, or at two shapes: fp8's own numbers)."""
    assert f"save:{saved}" not in records, records.get(f"save:{saved}", {}).get("error")
    record = records[f"{saved}->{loaded}"]
    assert "error" not in record, record.get("error")
    assert record["weight_diff"] == 0.0
    assert all(math.isfinite(x) for x in record["losses"])
    if not (SHAPES[saved][3] or SHAPES[loaded][3]) or saved == loaded:
        torch.testing.assert_close(record["losses"], record["expected"], rtol=0, atol=TOL)
        assert record["after_diff"] <= TOL
    else:
        torch.testing.assert_close(record["losses"], record["expected"], rtol=0, atol=FP8_TOL)


SUBSET = matrix_checks.subset_pairs()
PAIRS = [(a, b) for a in SHAPES for b in SHAPES]


@pytest.mark.parametrize("saved, loaded", SUBSET, ids=[f"{a}->{b}" for a, b in SUBSET])
def test_each_shape_loads_at_another_and_at_one_process(quick, saved, loaded):
    _check(quick, saved, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_shape_loads_at_every_shape(every, saved, loaded):
    _check(every, saved, loaded)


# ---------------------------------------------------------------------- all or nothing
def _prepared(opt_class=torch.optim.AdamW, plugin=None, **opt_kwargs):
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(3)
    model = Llama()
    opt = opt_class(model.parameters(), lr=1e-2, **opt_kwargs)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt):
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=8)))
    acc.pipeline_step(model, x, y, loss_fn)
    opt.step()
    opt.zero_grad()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded():
    from hasten import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")


@pytest.mark.parametrize("layout", ["full", "dcp"])
@pytest.mark.parametrize("stepped", [True, False])
def test_another_optimizer_is_refused_before_anything_changes(tmp_path, layout, stepped):
    """A checkpoint of SGD with momentum into AdamW: the state keys differ, which reading says
    (naming the parameter and both key sets) before the model or the optimizer changed."""
    plugin = _sharded() if layout == "dcp" else None
    acc, model, opt = _prepared(torch.optim.SGD, plugin, momentum=0.9)
    _step(acc, model, opt)
    acc.save_state(tmp_path / "ck")
    acc, model, opt = _prepared(plugin=plugin)
    if stepped:
        _step(acc, model, opt)
    before, state = _params(model), {k: dict(v) for k, v in opt.optimizer.state.items()}
    with pytest.raises(Exception, match=r"optimizer 0.*momentum_buffer.*exp_avg.*another optimizer"):
        acc.load_state(tmp_path / "ck")
    for k, t in _params(model).items():
        torch.testing.assert_close(t, before[k], rtol=0, atol=0)
    if layout == "full":  # (the sharded reader makes an un-stepped optimizer's state to read into: torch's)
        assert set(opt.optimizer.state) == set(state)


def test_a_failing_optimizer_restore_leaves_the_models_as_they_were(tmp_path, monkeypatch):
    """Should torch refuse an optimizer state that reading matched, the optimizers are restored
    before the models: the error says the optimizers failed, and the parameters are the old ones."""
    acc, model, opt = _prepared()
    _step(acc, model, opt)
    acc.save_state(tmp_path / "ck")
    acc, model, opt = _prepared()
    before = _params(model)

    def refuse(optimizer, state_dict):
        raise RuntimeError("refused")

    monkeypatch.setattr(acc.strategy, "load_optimizer_state_dict", refuse)
    with pytest.raises(RuntimeError, match=r"restoring the optimizers .* failed \(RuntimeError: refused\)"):
        acc.load_state(tmp_path / "ck")
    for k, t in _params(model).items():
        torch.testing.assert_close(t, before[k], rtol=0, atol=0)


@pytest.mark.parametrize("keyed", ["index", "names"])
def test_an_optimizer_of_other_parameters_is_refused(tmp_path, keyed):
    """The parameter groups are matched by parameter names (a state keyed by index, torch's own,
    by its groups' sizes): a checkpoint whose optimizer updates other parameters says so."""
    from hasten import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT") if keyed == "names" else None
    acc, model, opt = _prepared(plugin=plugin)  # FSDP's full optimizer state is keyed by names
    _step(acc, model, opt)
    acc.save_state(tmp_path / "ck")
    acc = Accelerator(cpu=True)
    torch.manual_seed(3)
    model = Llama()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "output.weight"], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    before = _params(model)
    said = r"sizes \[23\], the prepared optimizer \[22\]" + (
        r".*only in the checkpoint: \['output.weight'\]" if keyed == "names" else ""
    )
    with pytest.raises(ValueError, match=r"optimizer 0 has parameter groups of " + said):
        acc.load_state(tmp_path / "ck")
    for k, t in _params(model).items():
        torch.testing.assert_close(t, before[k], rtol=0, atol=0)
