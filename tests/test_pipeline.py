"""Pipeline parallelism (ParallelismConfig.pp_size, issue 40): a 2-process launch of
scripts/pp_checks.py (every schedule, accumulation, evaluation, bad input, a checkpoint), a
4-process one (PP x FSDP, PP x TP, PP x replicas, a meta model, checkpoints at other shapes),
and in-process checks (one process loading those checkpoints, pipeline_step without a pipeline,
the config)."""

from __future__ import annotations

import json

import pytest
import torch
from pp_common import Llama, dataset, loss_fn

from conftest import SCRIPTS
from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from hasten.settings.pipeline import PIPELINE_SCHEDULES, TorchPipelineParallelConfig
from launch_utils import free_port, launch

TOL = 1e-5  # fp32: the pipeline's sums run in another order than one process's


def _launch(tmp_path_factory, name, processes):
    out = tmp_path_factory.mktemp(name)
    proc = launch(
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        SCRIPTS / "pp_checks.py",
        str(out),
        name,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(tmp_path_factory, "two", 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, "four", 4)


def _ok(entry):
    assert "error" not in entry, entry.get("error")
    return entry


def _trains_like_one_process(entry, main=True, tol=TOL):
    """``main``: the main process, which gathers the whole model's weights (the others get none)."""
    _ok(entry)
    assert entry["gathered_rows"] == [8 * entry["dp"]] * 2  # gather_for_metrics: each data rank's batch once
    torch.testing.assert_close(entry["losses"], entry["ref_losses"], rtol=0, atol=tol)
    torch.testing.assert_close(entry["norms"], entry["ref_norms"], rtol=0, atol=tol)
    if main:
        assert entry["weight_diff"] is not None and entry["weight_diff"] <= tol
    else:
        assert entry["weight_diff"] is None and entry["keys"] == []


# ---------------------------------------------------------------------- 2 processes
STAGES = {  # the stages each of the 2 processes holds (torch's placement: a loop, or a V)
    "GPipe": ([0], [1]),
    "1F1B": ([0], [1]),
    "Interleaved1F1B": ([0, 2], [1, 3]),
    "LoopedBFS": ([0, 2], [1, 3]),
    "InterleavedZeroBubble": ([0, 2], [1, 3]),
    "ZBVZeroBubble": ([0, 3], [1, 2]),
    "DualPipeV": ([0, 3], [1, 2]),
}


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_every_schedule_trains_like_one_process(two, schedule):
    """Per-step losses, clipped norms (over both stages) and final weights equal one process's."""
    _, ranks = two
    for r, res in enumerate(ranks):
        entry = res[schedule]
        _trains_like_one_process(entry, main=r == 0)
        assert entry["stages"] == STAGES[schedule][r] and entry["pp_rank"] == r
        assert entry["mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "cp", "sp", "tp"]
    # the ranks' parts hold disjoint keys under the whole model's names, together all of them
    parts = [set(res[schedule]["part_keys"]) for res in ranks]
    assert not parts[0] & parts[1] and parts[0] | parts[1] == set(ranks[0][schedule]["keys"])
    assert ranks[0][schedule]["keys"] == list(Llama().state_dict())  # the whole model's, in its order
    assert all(res[schedule]["part_class"] == "Llama" for res in ranks)  # unwrap_model: the user's class
    # the optimizer built before prepare updates only this process's parameters
    assert sum(res[schedule]["optimizer_params"] for res in ranks) == len(list(Llama().parameters()))


def test_the_tolerance_is_that_of_a_hand_written_pipelining_loop(two):
    """A hand-written torch.distributed.pipelining 1F1B loop gives hasten's losses."""
    _, ranks = two
    hand, ours = _ok(ranks[0]["hand_written"])["losses"], ranks[0]["1F1B"]["losses"]
    torch.testing.assert_close(ours, hand, rtol=0, atol=1e-6)
    hand_error = max(abs(a - b) for a, b in zip(hand, ranks[0]["1F1B"]["ref_losses"]))
    assert hand_error <= TOL


def test_split_points_choose_the_stages(two):
    _, ranks = two
    _trains_like_one_process(ranks[0]["split_points"])
    assert [k for k in ranks[1]["split_points"]["part_keys"] if k.startswith("layers.")][0].startswith("layers.1.")
    assert not any(k.startswith("layers.1.") for k in ranks[0]["split_points"]["part_keys"])


def test_gradient_accumulation_over_pipeline_steps(two):
    """Two pipeline_step calls per optimizer step (each of 4 microbatches), clipped: as one process."""
    _, ranks = two
    _trains_like_one_process(ranks[0]["accumulate"])


def test_compiled_blocks_and_fp8_compose(two):
    """Each block compiled (aot_eager) trains as one process; fp8 converts the Linear layers of
    every stage (once, before the split) and trains close to fp32 (torchao emulates fp8 on the CPU)."""
    _, ranks = two
    for r, res in enumerate(ranks):
        _trains_like_one_process(res["compiled"], main=r == 0)
        fp8 = _ok(res["fp8"])
        assert fp8["float8_layers"] > 0
        torch.testing.assert_close(fp8["losses"], fp8["ref_losses"], rtol=0, atol=0.05)


def test_under_no_grad_the_forward_only(two):
    _, ranks = two
    for res in ranks:
        entry = _ok(res["evaluation"])
        assert abs(entry["loss"] - entry["ref_loss"]) <= TOL and entry["grads"] == 0


def test_bad_input_is_refused_naming_the_problem(two):
    _, ranks = two
    bad = _ok(ranks[0]["bad_inputs"])
    assert (
        bad["split_point"]["type"] == "ValueError"
        and "split point 'layers.9' names no module" in (bad["split_point"]["message"])
    )
    assert bad["split_point"]["unchanged"]  # refused before anything changed the model
    assert "8 pipeline stages" in bad["too_many_stages"]["message"] and "4 blocks" in bad["too_many_stages"]["message"]
    assert "microbatches=4 does not divide the batch size 6" in bad["uneven_batch"]["message"]
    assert bad["forward"]["type"] == "RuntimeError" and "accelerator.pipeline_step" in bad["forward"]["message"]
    assert bad["loss_fn"]["type"] == "TypeError" and "loss_fn" in bad["loss_fn"]["message"]
    assert "fp16" in bad["fp16"]["message"] and "bf16" in bad["fp16"]["message"]


def test_a_checkpoint_loads_at_another_schedule(two):
    """Saved at PP 2 (1F1B, 2 stages), loaded at PP 2 (Interleaved1F1B, 4 stages): the weights,
    then the next step (the optimizer's state) as the saving run's."""
    _, ranks = two
    entry = _ok(ranks[0]["checkpoint"])["load0"]
    assert ranks[0]["checkpoint"]["save_model_diff"] == 0.0  # save_model: the whole model in one file
    assert entry["weight_diff"] == 0.0
    assert abs(entry["next_loss"] - ranks[0]["checkpoint"]["next_loss"]) <= TOL and entry["after_diff"] <= TOL


# ---------------------------------------------------------------------- 4 processes
@pytest.mark.parametrize(
    "case", ["pp2_fsdp2", "pp2_fsdp2_interleaved", "pp2_tp2", "pp2_ddp2", "pp2_fsdp2_meta_elsewhere"]
)
def test_pipeline_composes_with_the_data_and_tensor_dims(four, case):
    """PP 2 x FSDP 2 (also Interleaved, and a model on the meta device outside the main process),
    PP 2 x TP 2, PP 2 x 2 replicas: as one process on the global batches."""
    _, ranks = four
    for r, res in enumerate(ranks):
        _trains_like_one_process(res[case], main=r == 0)
        assert res[case]["param_types"] == ["DTensor"] and res[case]["distributed_type"] == "FSDP"


@pytest.mark.parametrize(
    "case, loads",
    [
        ("checkpoint", ("load0", "load1")),  # PP 2 x FSDP 2 -> FSDP 4, PP 4
        ("checkpoint_back", ("load0",)),  # FSDP 4 -> PP 2 x FSDP 2
        ("checkpoint_tp", ("load0",)),  # PP 2 x TP 2 -> PP 2 x FSDP 2
    ],
)
def test_pipeline_checkpoints_load_at_other_shapes(four, case, loads):
    _, ranks = four
    saved = _ok(ranks[0][case])
    assert saved["save_model_diff"] == 0.0  # save_model: the whole model in one file
    for load in loads:
        assert saved[load]["weight_diff"] == 0.0
        assert abs(saved[load]["next_loss"] - saved["next_loss"]) <= TOL and saved[load]["after_diff"] <= TOL


@pytest.mark.parametrize("which", ["two", "four"])
def test_a_pipeline_checkpoint_loads_at_one_process_and_merges(which, request, tmp_path):
    """Saved at PP 2 (and PP 2 x FSDP 2): loaded by one process without a pipeline, and merged."""
    from safetensors.torch import load_file

    from hasten.cli import main

    out, _ = request.getfixturevalue(which)
    folder = out / ("pp2" if which == "two" else "pp2_fsdp2")
    expected = torch.load(str(folder) + ".pt")
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    torch.manual_seed(7)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(folder)
    for k, t in expected["saved"].items():
        torch.testing.assert_close(model.state_dict()[k], t, rtol=0, atol=0)
    x, y = expected["batch"]
    loss = loss_fn(model(x), y)  # the saving run's next step: the optimizer's state was loaded too
    acc.backward(loss)
    opt.step()
    assert abs(float(loss.detach()) - expected["next_loss"]) <= TOL
    for k, t in expected["after"].items():
        torch.testing.assert_close(model.state_dict()[k], t, rtol=0, atol=TOL)
    assert main(["merge-weights", str(folder), str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(expected["saved"])
    for k, t in expected["saved"].items():
        torch.testing.assert_close(merged[k], t, rtol=0, atol=0)


# ---------------------------------------------------------------------- in-process
def test_pipeline_step_without_a_pipeline_is_forward_and_backward():
    """One loop runs with and without pipeline parallelism: without, pipeline_step is the
    forward, the loss, and accelerator.backward (divided by the accumulation steps)."""
    torch.manual_seed(0)
    model = Llama()
    ref = Llama()
    ref.load_state_dict(model.state_dict())
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = acc.prepare(model)
    x, y = next(iter(torch.utils.data.DataLoader(dataset(), batch_size=8)))
    loss = acc.pipeline_step(model, x, y, loss_fn)
    (loss_fn(ref(x), y) / 2).backward()
    assert not loss.requires_grad and abs(float(loss) - float(loss_fn(ref(x), y))) < 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with torch.no_grad():
        acc.pipeline_step(model, x, y, loss_fn)  # the forward only: the gradients stay
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        acc.pipeline_step(model, x, y, None)


def test_the_config_checks_pp_where_it_is_given(monkeypatch):
    pc = ParallelismConfig(pp_size=2, dp_shard_size=2)
    assert pc.total_size == 4 and pc.pp_enabled and pc.pp_handler == TorchPipelineParallelConfig()
    assert pc.non_data_parallel_size == 2 and pc.data_parallel_size == 2 and "pp" in pc.active_mesh_dims
    with pytest.raises(ValueError, match=r"pp_size=2, dp_replicate_size=1, dp_shard_size=2.*multiplies to 4"):
        pc.check_num_processes(2)
    with pytest.raises(ValueError, match="ParallelismConfig.pp_size"):
        ParallelismConfig(pp_size=0)
    with pytest.raises(TypeError, match="pp_handler must be a TorchPipelineParallelConfig"):
        ParallelismConfig(pp_size=2, pp_handler={"schedule": "1F1B"})
    with pytest.raises(ValueError, match="3 stages.*do not share out evenly over pp_size=2"):
        ParallelismConfig(pp_size=2, pp_handler=TorchPipelineParallelConfig(split_points=["layers.1", "layers.2"]))
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    assert acc.pipeline_parallel_rank == 0
