"""Accelerate's names that scripts import, as hasten offers them (issue 20; measured by `make peer`).

Multi-process checks run in one launch of scripts/dropin_checks.py; ``debug_launcher`` and
``notebook_launcher`` start their own processes, so they run in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from conftest import SCRIPTS, torchrun
from launch_utils import free_port, launch_env


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin")
    proc = torchrun(SCRIPTS / "dropin_checks.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# ---------------------------------------------------------------------- DistributedType
def test_distributed_type_has_accelerates_members():
    from hasten import DistributedType

    names = {
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_XPU",
        "DEEPSPEED",
        "FSDP",
        "XLA",
        "MEGATRON_LM",
        "MULTI_HPU",
        "MULTI_NEURON",
    }
    assert names <= set(DistributedType.__members__)
    assert all(DistributedType[n].value == n for n in names)  # values too, as in Accelerate
    assert (DistributedType.NO == DistributedType.XLA) is False
    assert DistributedType("MULTI_CPU") is DistributedType.MULTI_CPU


def test_comparisons_with_members_hasten_does_not_run_are_false(ranks):
    for res in ranks:
        assert res["distributed_type"] == "MULTI_CPU"
        assert res["distributed_type_xla"] is False


# ---------------------------------------------------------------------- reduce
def test_reduce_reductions(ranks):
    for res in ranks:  # rank 0 holds 2, rank 1 holds 3
        assert res["reduce"] == {"sum": 5.0, "mean": 2.5, "max": 3.0, "min": 2.0, "product": 6.0, "none": 5.0}
        assert res["reduce_default"] == 2.5  # the free function averages by default, as Accelerate's


def test_reduce_single_process_and_bad_reduction():
    from hasten.utils import reduce

    t = torch.tensor([1.0, 2.0])
    out = reduce(t, "max")
    assert torch.equal(out, t) and out is not t
    with pytest.raises(ValueError, match="reduction.*'max'.*'avg'"):
        reduce(t, "avg")


def test_debug_mode_reports_mismatched_shapes(ranks):
    for res in ranks:
        assert res["debug_raised"] and "(2,)" in res["debug_raised"] and "(3,)" in res["debug_raised"]


def test_synchronize_rng_states(ranks):
    assert ranks[0]["rng_after_sync"] == ranks[1]["rng_after_sync"]  # seeded differently before


# ---------------------------------------------------------------------- PartialState
def test_partial_state_split_between_processes(ranks):
    assert ranks[0]["split"] == [0, 1, 2] and ranks[1]["split"] == [3, 4]
    assert ranks[1]["split_padded"] == [3, 4, 4]


def test_partial_state_main_process_first(ranks):
    # rank 0 sleeps 0.5 s inside the block; rank 1 enters only after it left
    assert ranks[1]["main_first_t"] - ranks[0]["main_first_t"] >= 0.45


def test_partial_state_decorators_and_print(ranks):
    assert [r["on_main"] for r in ranks] == ["ran", None]
    assert [r["on_last"] for r in ranks] == [None, "ran"]
    assert [r["on_process_1"] for r in ranks] == [None, "ran"]
    assert ranks[0]["printed"] == "hello from 0\n" and ranks[1]["printed"] == ""


def test_partial_state_destroy_process_group(ranks):
    assert all(r["destroyed"] for r in ranks)


def test_partial_state_single_process_helpers(capsys):
    from hasten import PartialState

    state = PartialState()
    state.print("x")
    assert capsys.readouterr().out == "x\n"
    with state.split_between_processes({"a": [1, 2]}) as part:
        assert part == {"a": [1, 2]}
    with state.local_main_process_first():
        pass
    assert state.on_local_main_process(lambda: 1)() == 1
    state.destroy_process_group()  # no group: nothing to do


# ---------------------------------------------------------------------- AcceleratorState / GradientState
def test_accelerator_state_agrees_with_accelerator(ranks):
    for r, res in enumerate(ranks):
        assert res["acc_state"] == {
            "num_processes": 2,
            "process_index": r,
            "mixed_precision": "no",
            "device": "cpu",
            "distributed_type": "MULTI_CPU",
            "is_main": r == 0,
        }
        assert res["gradient_state_same"]


def test_accelerator_state_reflects_the_most_recent_accelerator():
    from hasten import Accelerator, AcceleratorState, GradientState

    AcceleratorState._reset_state()
    assert AcceleratorState().mixed_precision == "no"
    first = Accelerator(gradient_accumulation_steps=2)
    assert GradientState() is first.gradient_state
    second = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=3)
    state = AcceleratorState()
    assert state.mixed_precision == "bf16" and state.device == second.device
    assert GradientState() is second.gradient_state and GradientState().num_steps == 3
    assert GradientState(5).num_steps == 5 and GradientState(5) is not second.gradient_state
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*'bf16'"):
        AcceleratorState(mixed_precision="fp16")
    with pytest.raises(TypeError, match="deepspeed_plugin"):
        AcceleratorState(deepspeed_plugin=object())
    second.gradient_accumulation_steps = 6
    assert GradientState().num_steps == 6
    AcceleratorState._reset_state()
    assert GradientState() is not second.gradient_state


# ---------------------------------------------------------------------- register_for_checkpointing
def test_register_for_checkpointing_without_state_dict_is_value_error():
    from hasten import Accelerator

    with pytest.raises(ValueError, match=r"state_dict\(\).*Item at index 0 \(object\)"):
        Accelerator().register_for_checkpointing(object())


# ---------------------------------------------------------------------- data loading
def test_prepare_data_loader_accelerate_signature(ranks):
    assert ranks[0]["prepared_batches"] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert ranks[1]["prepared_batches"] == [[2, 3], [6, 7], [10, 11], [14, 15]]


def test_skip_first_batches_on_a_prepared_loader(ranks):
    assert ranks[0]["skipped_batches"] == [[8, 9], [12, 13]]
    assert ranks[1]["skipped_batches"] == [[10, 11], [14, 15]]


def test_iterable_datasets_sharded_per_rank(ranks):
    assert ranks[0]["iterable_shard"] == [0, 1, 4, 5, 8, 9]
    assert ranks[1]["iterable_shard"] == [2, 3, 6, 7, 0, 1]  # the last global batch completed from the start
    assert [x for b in ranks[0]["iterable_prepared"] for x in b] == [0, 1, 4, 5, 8, 9]


def test_iterable_datasets_are_dispatched_by_default(ranks):
    # As Accelerate: the main process reads the stream; the last batch ([8, 9]) is cut in two.
    assert ranks[0]["iterable_dispatched"] == {"kind": "DataLoaderDispatcher", "batches": [[0, 1], [4, 5], [8]]}
    assert ranks[1]["iterable_dispatched"] == {"kind": "DataLoaderDispatcher", "batches": [[2, 3], [6, 7], [9]]}


def test_skip_first_batches_on_plain_loaders():
    from hasten import skip_first_batches
    from hasten.data_loader import SkipBatchSampler, SkipDataLoader

    dl = skip_first_batches(DataLoader(list(range(10)), batch_size=3), 2)
    assert isinstance(dl.batch_sampler, SkipBatchSampler) and len(dl) == 2
    assert [b.tolist() for b in dl] == [[6, 7, 8], [9]]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(7))

    dl = skip_first_batches(DataLoader(Stream(), batch_size=2), 1)
    assert isinstance(dl, SkipDataLoader)
    assert [b.tolist() for b in dl] == [[2, 3], [4, 5], [6]]
    with pytest.raises(ValueError, match="num_batches"):
        skip_first_batches(DataLoader(list(range(4))), -1)


def test_data_classes_with_accelerates_signatures():
    from torch.utils.data import BatchSampler, SequentialSampler

    from hasten.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, prepare_data_loader

    bs = BatchSampler(SequentialSampler(range(10)), 3, False)
    assert list(BatchSamplerShard(bs, 2, 1)) == [[3, 4, 5], [9, 0, 1]]
    assert list(BatchSamplerShard(bs, 2, 0, even_batches=False)) == [[0, 1, 2], [6, 7, 8]]
    with pytest.raises(ValueError, match="process_index must be < num_processes=2, got 2"):
        BatchSamplerShard(bs, 2, 2)
    assert list(IterableDatasetShard(range(10), 2, drop_last=True, num_processes=2, process_index=1)) == [2, 3, 6, 7]
    a = list(SeedableRandomSampler(range(50), data_seed=3))
    assert a == list(SeedableRandomSampler(range(50), data_seed=3)) and sorted(a) == list(range(50))
    assert a != list(SeedableRandomSampler(range(50), data_seed=4))
    dl = prepare_data_loader(DataLoader(list(range(8)), batch_size=2), num_processes=2, process_index=1)
    assert [b.tolist() for b in dl] == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match=r"dispatch_batches=True needs the batches placed on the device"):
        prepare_data_loader(DataLoader(list(range(8))), dispatch_batches=True)


# ---------------------------------------------------------------------- launchers
_LAUNCH = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from hasten import Accelerator, AcceleratorState, {launcher}

    def train(out, tag):
        acc = Accelerator()
        total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), "sum").item()
        with open(os.path.join(out, f"{{tag}}{{acc.process_index}}.json"), "w") as f:
            json.dump({{"n": acc.num_processes, "total": total, "backend": acc.state.backend,
                       "mp": AcceleratorState().mixed_precision, "pid": os.getpid()}}, f)

    {call}
    """
)


def _run_launcher(tmp_path, launcher: str, call: str, timeout: float = 180) -> subprocess.CompletedProcess:
    code = _LAUNCH.format(launcher=launcher, call=call)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def test_debug_launcher_runs_two_gloo_processes(tmp_path):
    proc = _run_launcher(tmp_path, "debug_launcher", "debug_launcher(train, args=(sys.argv[1], 'r'), num_processes=2)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert [r["n"] for r in ranks] == [2, 2] and [r["total"] for r in ranks] == [3.0, 3.0]
    assert {r["backend"] for r in ranks} == {"gloo"} and ranks[0]["pid"] != ranks[1]["pid"]


def test_debug_launcher_reports_a_failing_process(tmp_path):
    code = textwrap.dedent(
        """
        from hasten import debug_launcher, PartialState
        def boom():
            if PartialState().process_index == 1:
                raise RuntimeError("boom on rank 1")
        debug_launcher(boom, num_processes=2)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "boom on rank 1" in proc.stderr


def test_notebook_launcher_cpu_two_processes(tmp_path):
    call = (
        "notebook_launcher(train, args=(sys.argv[1], 'n'), num_processes=2, mixed_precision='bf16', "
        f"use_port='{free_port()}')"
    )
    proc = _run_launcher(tmp_path, "notebook_launcher", call)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"n{r}.json").read_text()) for r in range(2)]
    assert [r["total"] for r in ranks] == [3.0, 3.0] and {r["mp"] for r in ranks} == {"bf16"}


def test_launcher_arguments_are_checked():
    from hasten import Accelerator, debug_launcher, notebook_launcher

    with pytest.raises(ValueError, match="mixed_precision.*'fp4'"):
        notebook_launcher(print, mixed_precision="fp4", num_processes=2)
    with pytest.raises(ValueError, match="node_rank must be less than num_nodes=1, got 1"):
        notebook_launcher(print, num_processes=2, node_rank=1)
    with pytest.raises(ValueError, match="num_processes"):
        debug_launcher(print, num_processes=0)
    Accelerator()
    with pytest.raises(RuntimeError, match="before any Accelerator exists"):
        debug_launcher(print, num_processes=2)
    seen = []
    notebook_launcher(seen.append, args=("one",), num_processes=1)  # one process: runs here
    assert seen == ["one"]


def test_launchers_are_importable_lazily():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hasten, hasten.utils, sys; "
            "assert 'hasten.distributed.launchers' not in sys.modules; from hasten.utils import debug_launcher; "
            "from hasten import notebook_launcher; print(debug_launcher.__module__, notebook_launcher.__module__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.split() == ["hasten.distributed.launchers", "hasten.distributed.launchers"]


def test_dataloader_shard_with_accelerates_constructor():
    from hasten import Accelerator
    from hasten.data_loader import DataLoaderShard

    dl = DataLoaderShard(list(range(16)), batch_size=4)
    for _ in range(2):  # end_of_dataloader is True during the last batch only, every epoch
        assert [(b.tolist()[0], dl.end_of_dataloader) for b in dl] == [(0, False), (4, False), (8, False), (12, True)]
    assert dl.iteration == 2
    dl = DataLoaderShard(list(range(16)), batch_size=4, skip_batches=3)
    assert [b.tolist() for b in dl] == [[12, 13, 14, 15]]
    assert [b.tolist()[0] for b in dl] == [0, 4, 8, 12]  # the skip applies to the first iteration
    assert isinstance(Accelerator().prepare(DataLoader(list(range(4)), batch_size=2)), DataLoaderShard)
    assert not isinstance(DataLoader(list(range(4))), DataLoaderShard)
    with pytest.raises(ValueError, match="use_stateful_dataloader"):
        DataLoaderShard(list(range(4)), use_stateful_dataloader=True)


def test_logger_respects_a_wrappers_stacklevel(caplog):
    import logging

    from hasten.logging import get_logger

    inner = get_logger("dropin.stack")

    class Wrapper(logging.LoggerAdapter):  # a user's wrapper that asks for its caller's line, as in Accelerate's test
        def log(self, level, msg, *args, **kwargs):
            kwargs["stacklevel"] = 3
            self.logger.log(level, msg, *args, **kwargs)

    with caplog.at_level(logging.INFO, logger="dropin.stack"):
        line = sys._getframe().f_lineno + 1
        Wrapper(inner, {}).warning("wrapped")
        inner.warning("plain")
        inner.warning_once("once")
    assert [(r.filename, r.lineno) for r in caplog.records] == [("test_dropin.py", line + i) for i in range(3)]


def test_prepared_objects_are_instances_of_accelerates_names():
    from hasten import Accelerator, DataLoaderConfiguration
    from hasten.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard, SeedableRandomSampler

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    dl = acc.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    assert isinstance(dl, DataLoaderShard) and isinstance(dl.batch_sampler, BatchSamplerShard)
    assert isinstance(dl.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    plain = Accelerator().prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))  # Accelerate's default
    assert type(plain.batch_sampler.batch_sampler.sampler) is torch.utils.data.RandomSampler
    assert not isinstance(dl.batch_sampler, IterableDatasetShard)
    assert not isinstance(torch.utils.data.RandomSampler(range(3)), SeedableRandomSampler)


def test_batch_sampler_shard_split_batches_checks():
    from torch.utils.data import BatchSampler

    from hasten.data_loader import BatchSamplerShard

    with pytest.raises(ValueError, match="round multiple of num_processes=2, got batch_size=3"):
        BatchSamplerShard(BatchSampler(range(20), batch_size=3, drop_last=False), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="split_batches=True.*batch_size attribute"):
        BatchSamplerShard([[0, 1], [2, 3]], 2, 0, split_batches=True)


def test_sync_gradients_is_settable():
    from hasten import Accelerator

    acc = Accelerator()
    acc.sync_gradients = False
    assert acc.gradient_state.sync_gradients is False
    with pytest.raises(TypeError, match="sync_gradients must be True or False"):
        acc.sync_gradients = 1


# ---------------------------------------------------------------------- the device from the environment
@pytest.mark.parametrize("name", ["HASTEN_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE"])
def test_torch_device_from_the_environment(monkeypatch, name):
    from hasten import Accelerator, PartialState

    monkeypatch.setenv(name, "cpu:3")
    assert str(Accelerator().state.device) == "cpu:3" and str(PartialState().device) == "cpu:3"
    assert Accelerator(cpu=True).device == torch.device("cpu")  # the argument wins
    monkeypatch.setenv(name, "tpu:0")
    with pytest.raises(ValueError, match=f"{name}='tpu:0' must name a 'cpu' or 'cuda' device"):
        PartialState()


def test_pad_across_processes_leaves_a_nested_tensor_with_a_warning():
    from hasten.utils import CannotPadNestedTensorWarning, pad_across_processes

    nt = torch.nested.nested_tensor([torch.ones(3), torch.ones(1)], layout=torch.jagged)
    with pytest.warns(CannotPadNestedTensorWarning, match="nested tensor cannot be padded"):
        assert pad_across_processes({"x": nt})["x"] is nt


def test_trigger_sync_in_backward_after_forwards_under_no_sync(ranks):
    # rank r's inputs are r+1 then r+2: the first backward keeps the local gradient, the triggered
    # one averages the sum (r+1 + r+2) over both ranks: (3 + 5) / 2 = 4 per weight on both ranks.
    assert ranks[0]["grad_after_local_backward"] == [[1.0, 1.0, 1.0]]
    assert ranks[1]["grad_after_local_backward"] == [[2.0, 2.0, 2.0]]
    assert ranks[0]["grad_after_triggered_backward"] == ranks[1]["grad_after_triggered_backward"] == [[4.0, 4.0, 4.0]]


def test_trigger_sync_in_backward_on_one_process_is_a_plain_block():
    from hasten import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 1))
    with acc.trigger_sync_in_backward(model):
        acc.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad.tolist() == [[1.0, 1.0]]


def test_reset_state_empties_existing_states_until_a_new_one_exists():
    from hasten import Accelerator, AcceleratorState, PartialState

    acc = Accelerator()
    state = acc.state
    assert isinstance(state, PartialState) and AcceleratorState() is state
    with pytest.raises(AttributeError, match="^'AcceleratorState' object has no attribute 'someotherthing'$"):
        _ = state.someotherthing  # the attribute read is what raises
    AcceleratorState._reset_state()
    with pytest.raises(
        AttributeError,
        match=(
            r"`AcceleratorState` object has no attribute `num_processes`\. This happens if "
            r"`AcceleratorState._reset_state\(\)`"
        ),
    ):
        _ = acc.num_processes  # the attribute read is what raises
    with pytest.raises(AttributeError, match="This happens if `AcceleratorState._reset_state"):
        acc.prepare(torch.nn.Linear(1, 1))
    assert acc._models == []  # refused before any change
    state.someotherthing = "value"  # a reset state still takes attributes
    assert state.someotherthing == "value" and repr(state) == "AcceleratorState(reset)"
    newer = Accelerator(mixed_precision="bf16")
    assert (
        state.num_processes == 1 and state.mixed_precision == "bf16"
    )  # reads the new one, as Accelerate's shared state
    assert AcceleratorState() is newer.state
    partial = PartialState()
    assert PartialState._shared_state["num_processes"] == 1 and PartialState._shared_state["_cpu"] is False
    PartialState._reset_state()
    assert PartialState._shared_state == {}
    with pytest.raises(
        AttributeError,
        match="`PartialState` object has no attribute `device`. This happens if `PartialState._reset_state",
    ):
        _ = partial.device  # the attribute read is what raises
    assert newer.device == torch.device("cpu")  # resetting PartialState leaves AcceleratorStates alone
    PartialState()
    assert partial.device == torch.device("cpu")


@pytest.mark.parametrize(
    "system,release,warned",
    [
        ("Linux", "5.4.0-35-generic", True),
        ("Linux", "5.15.0-35-generic", False),
        ("Darwin", "5.4.0", False),
    ],
)
def test_check_os_kernel(monkeypatch, caplog, system, release, warned):
    import platform
    from types import SimpleNamespace

    from hasten.utils import check_os_kernel

    monkeypatch.setattr(platform, "uname", lambda: SimpleNamespace(system=system, release=release))
    with caplog.at_level("WARNING"):
        check_os_kernel()
    messages = [r.getMessage() for r in caplog.records]
    assert (len(messages) == 1 and "5.4.0" in messages[0] and "5.5.0" in messages[0]) if warned else messages == []


def test_is_available_helpers_answer_for_this_machine():
    import importlib.util
    import subprocess
    import sys

    import hasten.utils as hu

    names = [n for n in dir(hu) if n.startswith("is_") and n.endswith("_available")]
    assert len(names) == 58  # every one of Accelerate 1.15's accelerate.utils.is_*_available
    for name in names:
        assert isinstance(getattr(hu, name)(), bool), name
    assert hu.is_tensorboard_available() and hu.is_tqdm_available()  # the test extra installs them
    assert hu.is_schedulefree_available() == (importlib.util.find_spec("schedulefree") is not None)
    assert hu.is_cuda_available() == torch.cuda.is_available()
    assert not hu.is_npu_available() and not hu.is_xpu_available() and not hu.is_mlu_available()
    assert hu.is_bf16_available() and hu.is_torch_distributed_available() and hu.is_weights_only_available()
    assert hu.is_numpy_available() and not hu.is_numpy_available(min_version="999.0")
    from hasten.utils.imports import is_npu_available  # Accelerate's module path

    assert is_npu_available is hu.is_npu_available
    # cheap: asking imports none of the packages asked about
    code = (
        "import sys, hasten.utils as m; m.is_matplotlib_available(); m.is_wandb_available(); "
        "print('matplotlib' in sys.modules, 'wandb' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_lomo_backward_is_refused_by_name():
    from hasten import Accelerator

    with pytest.raises(NotImplementedError, match="lomo_backward: hasten does not run LOMO optimizers"):
        Accelerator(cpu=True).lomo_backward(torch.tensor(1.0), 0.1)
