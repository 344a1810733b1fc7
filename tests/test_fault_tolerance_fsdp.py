"""FSDP2 inside each replica group, torchft across the groups (hasten.strategies.fault_tolerance_fsdp).

Fast: what is refused, by name, before the lighthouse is reached; a DTensor state dict through
the shard encoding a rejoining group receives.
Slow: two replica groups of two gloo processes each and ``hasten lighthouse``: no faults, with
gradient accumulation (the weights of one process training on the global batch, the shards equal
across groups at every step);
one group SIGKILLed mid-run and restarted (the other keeps committing, the rejoined group heals its
shards and Adam's state from its peer, equal weights after, both finish); HSDP inside a group;
``save_state`` into one folder (DCP), a full stop and ``load_state``: the run goes on exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from launch_utils import SCRIPTS, free_port

pytest.importorskip("torchft")

from hasten import Accelerator, FaultToleranceKwargs, FullyShardedDataParallelPlugin, ParallelismConfig  # noqa: E402
from test_fault_tolerance import _Job, _wait_for  # noqa: E402 - the lighthouse and groups, as there


# ---------------------------------------------------------------------------- refusals (fast)
class _Processes:
    """A process state of a group of ``n`` processes (the refusals read no more of it)."""

    def __init__(self, n: int) -> None:
        self.use_distributed, self.num_processes = n > 1, n


@pytest.mark.parametrize(
    ("sharding", "handler", "processes", "words"),
    [
        ("plugin", {"semi_sync": "diloco"}, 2, r"\(fsdp_plugin=...\) is not supported with semi_sync='diloco'"),
        ("plugin", {}, 1, r"\(fsdp_plugin=...\) is not supported with a replica group of 1 process"),
        ("ignored", {}, 2, r"FullyShardedDataParallelPlugin\(ignored_modules='0'\): FSDP reduces no"),
        ({"tp_size": 2, "dp_shard_size": 2}, {}, 4, r"is not supported with ParallelismConfig\(tp_size=2\): only"),
        ({"dp_replicate_size": 2}, {}, 2, r"ParallelismConfig\(dp_shard_size=1, dp_replicate_size=2\): that only"),
    ],
)
def test_what_fsdp_inside_a_group_refuses_comes_before_the_lighthouse(sharding, handler, processes, words):
    """Each refusal names the field; the lighthouse (an address nothing listens on) is never reached."""
    from hasten.strategies import fault_tolerance

    plugin, config = None, None
    if sharding == "plugin":
        plugin = FullyShardedDataParallelPlugin()
    elif sharding == "ignored":
        plugin = FullyShardedDataParallelPlugin(ignored_modules="0")
    else:
        config = ParallelismConfig(**sharding)
    kwargs = FaultToleranceKwargs(lighthouse=f"http://127.0.0.1:{free_port()}", **handler)
    with pytest.raises(ValueError, match=words):
        fault_tolerance.start(kwargs, _Processes(processes), None, plugin, config)


def test_a_one_process_accelerator_with_fsdp_and_fault_tolerance_is_refused():
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=r"is not supported with a replica group of 1 process"):
        plugin = FullyShardedDataParallelPlugin()
        Accelerator(kwargs_handlers=[FaultToleranceKwargs(lighthouse=address)], fsdp_plugin=plugin)


def test_dtensor_state_goes_as_local_shards_and_comes_back_on_the_receivers_mesh(tmp_path):
    """What torchft's transport carries: each DTensor as its local tensor, placements and global
    shape (plain tensors the transport moves and pickles); rebuilt on the receiving optimizer's
    parameters' mesh, equal to what was sent (one process, a gloo group of its own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hasten.strategies.fault_tolerance_fsdp import _SHARD, _from_local, _to_local

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]))
        sent_opt = torch.optim.Adam([param])
        param.grad = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
        sent_opt.step()
        sent = _to_local(sent_opt.state_dict())
        entry = sent["state"][0]["exp_avg"]
        assert entry[_SHARD] and type(entry["local"]) is torch.Tensor and entry["shape"] == (5, 3)
        assert entry["placements"] == (Shard(0),)
        other = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]))
        got = torch.optim.Adam([other])
        got.load_state_dict(_from_local(sent, got))
        exp_avg = got.state[other]["exp_avg"]
        assert isinstance(exp_avg, DTensor) and exp_avg.placements == (Shard(0),)
        assert torch.equal(exp_avg.full_tensor(), sent_opt.state[param]["exp_avg"].full_tensor())
        assert torch.equal(got.state[other]["step"], sent_opt.state[param]["step"])
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- two groups (slow)
class _FsdpJob(_Job):
    """``hasten lighthouse`` and one ``hasten launch`` of ft_fsdp_train.py per replica group."""

    def start(self, group: int, tag: str, steps: int, pause: float, processes: int = 2) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "hasten.cli", "launch", "--num_processes", str(processes),
            "--ft_replica_group", str(group), "--ft_num_replica_groups", str(self.num_groups),
            "--ft_lighthouse", f"http://localhost:{self.port}",
            str(SCRIPTS / "ft_fsdp_train.py"), str(self.out), str(steps), tag, str(pause),
        ]  # fmt: skip
        log = open(self.out / f"g{group}{tag}.log", "w")  # noqa: SIM115 - closed with the process
        self.groups[f"{group}{tag}"] = p = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return p

    def result(self, group: int, tag: str, rank: int = 0) -> dict:
        import json

        return json.loads((self.out / f"group{group}_{tag}_rank{rank}.json").read_text())


def _reference(steps: int, rows_per_step: int) -> list[float]:
    """The script's model, Adam and clipping in one plain process: step k reads the global batch
    (samples ``k * rows_per_step ...`` of the 64, in turn), every group's and rank's batches at once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 3, generator=g)
    for k in range(steps):
        start = (k * rows_per_step) % 64
        loss = torch.nn.functional.mse_loss(model(x[start : start + rows_per_step]), y[start : start + rows_per_step])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def _reference_on(batches: list[list[int]]) -> list[float]:
    """:func:`_reference`'s training with step k on the samples ``batches[k]`` (the 4 processes'
    batches of 4, concatenated: the mean over them is the average of their means)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 3, generator=g)
    for rows in batches:
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(p - q) for p, q in zip(a, b, strict=True))


def _run_without_faults(tmp_path, steps: int, processes: int, **extra: str) -> list[list[dict]]:
    job = _FsdpJob(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", **extra)
    try:
        groups = [job.start(g, "a", steps, 0.0, processes=processes) for g in (0, 1)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=360) == 0, job.log(f"{g}a")
    finally:
        job.close()
    return [[job.result(g, "a", r) for r in range(processes)] for g in (0, 1)]


@pytest.mark.slow
def test_two_groups_of_two_fsdp_processes_train_as_one_process_on_the_global_batch(tmp_path):
    """FSDP2 over each group's 2 processes, torchft across the 2 groups, gradient accumulation over
    2 batches (``accelerator.accumulate``: FSDP's ``no_sync``, then one reduction inside the group
    and across the groups): the 4 processes read 4 disjoint shards; rank r's shards are equal in
    both groups after every step, and the gathered weights are those of one process on batches of
    32 (Adam, clipping on the global norm). Without accumulation: the resume test's first run."""
    results = _run_without_faults(tmp_path, 4, 2, FT_TEST_ACCUMULATE="2")
    ranks = [r for group in results for r in group]
    assert all(r["strategy"] == "FaultTolerantFSDPStrategy" and r["steps"] == [1, 2, 3, 4] for r in ranks)
    assert all(r["distributed_type"].endswith("FSDP") for r in ranks)
    for rank in (0, 1):  # the same shard in both groups, at every step
        assert results[0][rank]["by_step"] == results[1][rank]["by_step"]
    assert results[0][0]["by_step"]["1"] != results[0][1]["by_step"]["1"]  # the two ranks hold other shards
    seen = [r["seen"] for r in ranks]
    assert all(len(s) == 32 for s in seen) and sorted(i for s in seen for i in s) == sorted(list(range(64)) * 2)
    assert results[0][0]["final"] == results[1][0]["final"]
    assert _max_diff(results[0][0]["final"], _reference(4, 32)) < 1e-6
    assert _max_diff(results[0][0]["final"], _reference(4, 16)) > 1e-3  # not one update per batch


@pytest.mark.slow
def test_hsdp_inside_each_group(tmp_path):
    """ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): each group of 4 processes is HSDP
    (FSDP's all-reduce over dp_replicate inside the group, then torchft's across the groups): the 8
    processes read 8 disjoint shards, rank r's shards are equal in both groups after every step, and
    the weights are one process's on batches of 32."""
    results = _run_without_faults(tmp_path, 4, 4, FT_TEST_HSDP="1")
    ranks = [r for group in results for r in group]
    assert all(r["strategy"] == "FaultTolerantFSDPStrategy" and r["steps"] == [1, 2, 3, 4] for r in ranks)
    for rank in range(4):
        assert results[0][rank]["by_step"] == results[1][rank]["by_step"]
    assert sorted(i for r in ranks for i in r["seen"]) == sorted(list(range(64)) * 2)  # 8 shards, 2 epochs
    assert _max_diff(results[0][0]["final"], _reference(4, 32)) < 1e-6


@pytest.mark.slow
def test_a_killed_fsdp_group_rejoins_heals_its_shards_and_both_finish(tmp_path):
    """Group 1 (2 processes) SIGKILLed at step 6 and started again: group 0 commits on alone, the
    new group 1 heals (each rank its shard of the weights and of Adam's state, from the same rank of
    group 0; its first committed step is its peer's, not 1), the shards of both are equal at every
    step they share after, and the gathered weights at the end are equal."""
    job = _FsdpJob(tmp_path, min_replicas=1)
    try:
        first, victim = job.start(0, "a", 0, 0.05), job.start(1, "a", 0, 0.05)
        _wait_for(lambda: job.progress(1) >= 6, victim, job, "1a", timeout=240)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        at_kill = job.progress(0)
        (tmp_path / "progress1.txt").unlink()
        # group 0 trains on alone (once the lighthouse has let the dead group go) before group 1 comes back
        _wait_for(lambda: job.progress(0) >= at_kill + 3, first, job, "0a", timeout=240)
        again = job.start(1, "b", 0, 0.05)
        _wait_for(lambda: job.progress(1) >= 1, again, job, "1b", timeout=240)
        alone = job.progress(0) - at_kill
        (tmp_path / "target").write_text(str(job.progress(0) + 10))
        assert first.wait(timeout=300) == 0, job.log("0a")
        assert again.wait(timeout=300) == 0, job.log("1b")
    finally:
        job.close()
    target = int((tmp_path / "target").read_text())
    for rank in (0, 1):
        a, b = job.result(0, "a", rank), job.result(1, "b", rank)
        assert a["steps"][-1] == b["steps"][-1] == target
        rejoined = b["steps"][0]
        assert rejoined > at_kill + 1 and alone > 1, (rejoined, at_kill, alone)  # healed to its peer's step
        assert b["steps"] == list(range(rejoined, target + 1))
        assert all(a["by_step"][k] == b["by_step"][k] for k in b["by_step"])  # equal shards at every common step
    assert job.result(0, "a")["final"] == job.result(1, "b")["final"]
    print(f"group 0 committed {alone} steps alone; group 1 rejoined at step {rejoined}; both ended at {target}")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:mixed_precision='fp16' on the CPU")
def test_fp16_skips_an_update_on_every_group_and_rank_alike(tmp_path):
    """fp16 (FSDP's ShardedGradScaler): group 1 alone feeds an inf at its 3rd step; the gradient
    shards averaged across groups hold it in both groups, each group's scaler finds it over its
    ranks, so every process skips that update (not committed: the step count stays), halves the
    scale, and the shards stay equal across groups."""
    results = _run_without_faults(tmp_path, 5, 2, FT_TEST_FP16="1", FT_TEST_INF_STEP="3")
    ranks = [r for group in results for r in group]
    assert all(r["skipped"] == [False, False, True, False, False, False] for r in ranks), [r["skipped"] for r in ranks]
    assert all(r["steps"] == [1, 2, 2, 3, 4, 5] for r in ranks), [r["steps"] for r in ranks]
    assert all(r["scales"] == ranks[0]["scales"] for r in ranks) and ranks[0]["scales"][2] == ranks[0]["scales"][1] / 2
    for rank in (0, 1):
        assert results[0][rank]["by_step"] == results[1][rank]["by_step"]


@pytest.mark.slow
def test_a_resume_after_a_full_stop_is_exact(tmp_path):
    """Two groups of two FSDP processes save_state into one folder at committed step 2 (before
    ``zero_grad``) and train on to 5; then all four stop and start again from the folder: the
    committed step goes on from 2, and every step after it has the uninterrupted run's shards,
    batches and random draws, and the same gathered weights at the end (those of one process on
    the four processes' batches). Group 1 is one batch and one draw ahead of group 0, so each group
    takes its own position and generators back; group 0 alone wrote the folder (DCP shards and
    every group's positions), and after ``load_state`` the shards a rejoining group would receive
    are the loaded parameters."""
    job = _FsdpJob(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", FT_TEST_SAVE_AT="2", FT_TEST_OFFSET="1")
    try:
        for tag, env_tag in (("a", {}), ("b", {"FT_TEST_RESUME": "1", "FT_TEST_SAVE_AT": "-1"})):
            job.env.update(env_tag)
            groups = [job.start(g, tag, 5, 0.0) for g in (0, 1)]
            for g, p in enumerate(groups):
                assert p.wait(timeout=360) == 0, job.log(f"{g}{tag}")
    finally:
        job.close()
    assert sorted(f.name for f in tmp_path.glob("wrote*")) == ["wrote0_0", "wrote0_1"]  # group 0, run a only
    assert [p.parent.name for p in sorted((tmp_path / "ckpt").glob("*/__0_0.distcp"))] == ["model_0", "optimizer_0"]
    for rank in (0, 1):
        saved = torch.load(tmp_path / "ckpt" / f"fault_tolerance_groups_{rank}.pt", weights_only=True)
        assert saved["writer"] == 0 and sorted(saved["groups"]) == [0, 1]
        assert saved["groups"][0]["dataloaders"] != saved["groups"][1]["dataloaders"]  # group 1 a batch ahead
    a = [[job.result(g, "a", r) for r in (0, 1)] for g in (0, 1)]
    assert a[0][0]["seen"][:4] != a[1][0]["seen"][:4] and a[1][0]["draws"] != a[0][0]["draws"]
    batches = [[i for group in a for r in group for i in r["seen"][4 * k : 4 * k + 4]] for k in range(5)]
    assert _max_diff(a[0][0]["final"], _reference_on(batches)) < 1e-6  # the save changed nothing
    for g in (0, 1):
        for r in (0, 1):
            run, again = a[g][r], job.result(g, "b", r)
            assert run["steps"] == [1, 2, 3, 4, 5] and again["steps"] == [3, 4, 5]
            assert again["by_step"] == {k: run["by_step"][k] for k in ("3", "4", "5")}  # exact: the same floats
            assert again["seen"] == run["seen"][8:]
            assert again["draws"] == {k: run["draws"][k] for k in ("3", "4", "5")}
            assert again["healing_state"] is True
        assert _max_diff(job.result(g, "b")["final"], a[g][0]["final"]) < 1e-6
