"""Training through failures: FaultToleranceKwargs on torchft (hasten.strategies.fault_tolerance).

Fast: the handler's checks, an unreachable lighthouse, the refusals, and one replica group
training alone through ``hasten launch`` (commits, data shard, weights against a plain loop).
Slow: two replica groups and ``hasten lighthouse``, all real processes on gloo: no faults (the
weights of DDP over both groups), and one group SIGKILLed mid-run and restarted (the other keeps
committing, the rejoined group heals to its peer's weights at every common step, both finish).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from launch_utils import SCRIPTS, free_port, launch, launch_env

pytest.importorskip("torchft")

from hasten import Accelerator, FaultToleranceKwargs  # noqa: E402
from hasten.settings import environment as env  # noqa: E402


# ---------------------------------------------------------------------------- the handler
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"min_replicas": 0}, ValueError, "min_replicas must be >= 1, got 0"),
        ({"min_replicas": 1.5}, TypeError, "min_replicas"),
        ({"lighthouse": "localhost"}, ValueError, "lighthouse must be an address"),
        ({"lighthouse": "tcp://h:1"}, ValueError, "'tcp://h:1'"),
        ({"replica_group": 2, "num_replica_groups": 2}, ValueError, "replica_group=2 must be below"),
        ({"replica_group": -1}, ValueError, "replica_group must be >= 0"),
        ({"num_replica_groups": 0}, ValueError, "num_replica_groups must be >= 1"),
        ({"min_replicas": 3, "num_replica_groups": 2}, ValueError, "min_replicas=3 is more than"),
        ({"timeout": 5}, TypeError, "timeout must be a datetime.timedelta"),
        ({"quorum_timeout": timedelta(milliseconds=10)}, ValueError, "quorum_timeout must be at least 1 second"),
        ({"semi_sync": "sgd"}, ValueError, "semi_sync must be one of 'local_sgd', 'diloco'"),
        ({"sync_every": 0}, ValueError, "sync_every must be >= 1"),
        ({"init_sync": "yes"}, TypeError, "init_sync"),
    ],
)
def test_handler_refuses_bad_values_naming_the_field(kwargs, error, words):
    with pytest.raises(error, match="FaultToleranceKwargs") as caught:
        FaultToleranceKwargs(**kwargs)
    assert words in str(caught.value)


def test_handler_reads_the_launcher_and_torchft_variables(monkeypatch):
    for name in (env.HASTEN_FT_LIGHTHOUSE, env.HASTEN_FT_REPLICA_GROUP, env.HASTEN_FT_NUM_REPLICA_GROUPS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env.TORCHFT_LIGHTHOUSE, "http://torchft-host:1")
    assert FaultToleranceKwargs().resolved().lighthouse == "http://torchft-host:1"
    monkeypatch.setenv(env.HASTEN_FT_LIGHTHOUSE, "http://launcher-host:2")
    monkeypatch.setenv(env.HASTEN_FT_REPLICA_GROUP, "1")
    monkeypatch.setenv(env.HASTEN_FT_NUM_REPLICA_GROUPS, "3")
    got = FaultToleranceKwargs().resolved()
    assert (got.lighthouse, got.replica_group, got.num_replica_groups) == ("http://launcher-host:2", 1, 3)
    with pytest.warns(UserWarning, match="replica_group=0 in code overrides HASTEN_FT_REPLICA_GROUP=1"):
        assert (
            FaultToleranceKwargs(replica_group=0, lighthouse="http://code:3").resolved().lighthouse == "http://code:3"
        )
    monkeypatch.setenv(env.HASTEN_FT_REPLICA_GROUP, "3")  # not below the number of groups
    with pytest.raises(ValueError, match="replica_group=3 must be below num_replica_groups=3"):
        FaultToleranceKwargs().resolved()
    monkeypatch.delenv(env.HASTEN_FT_LIGHTHOUSE)
    monkeypatch.delenv(env.TORCHFT_LIGHTHOUSE)
    monkeypatch.delenv(env.HASTEN_FT_REPLICA_GROUP)
    with pytest.raises(ValueError, match="lighthouse is not set.*--ft_lighthouse.*TORCHFT_LIGHTHOUSE"):
        FaultToleranceKwargs().resolved()


def test_unreachable_lighthouse_is_an_error_naming_it_within_the_timeout():
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    handler = FaultToleranceKwargs(lighthouse=address, connect_timeout=timedelta(seconds=2))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"FaultToleranceKwargs.lighthouse '{address}' cannot be reached"):
        Accelerator(kwargs_handlers=[handler])
    assert time.monotonic() - start < 15


def test_refusals_come_before_the_lighthouse_is_reached():
    from hasten import FullyShardedDataParallelPlugin

    address = f"http://127.0.0.1:{free_port()}"  # never reached: each refusal comes first
    with pytest.raises(ValueError, match=r"FaultToleranceKwargs with Accelerator\(fsdp_plugin=...\) is not supported"):
        Accelerator(
            kwargs_handlers=[FaultToleranceKwargs(lighthouse=address)], fsdp_plugin=FullyShardedDataParallelPlugin()
        )
    with pytest.raises(NotImplementedError, match="semi_sync='diloco' is not implemented"):
        Accelerator(kwargs_handlers=[FaultToleranceKwargs(lighthouse=address, semi_sync="diloco")])
    with pytest.raises(ValueError, match="two FaultToleranceKwargs"):
        Accelerator(kwargs_handlers=[FaultToleranceKwargs(lighthouse=address), FaultToleranceKwargs()])


def test_cli_refuses_bad_ft_flags():
    proc = launch("--ft_replica_group", "2", "--ft_num_replica_groups", "2", SCRIPTS / "ft_single.py", timeout=60)
    assert proc.returncode == 2 and "ft_replica_group must be in 0 .. ft_num_replica_groups-1 = 1, got 2" in proc.stderr
    proc = launch("--ft_lighthouse", "localhost:1", SCRIPTS / "ft_single.py", timeout=60)
    assert proc.returncode == 2 and "ft_lighthouse must be an address" in proc.stderr
    cmd = [sys.executable, "-m", "hasten.cli", "lighthouse", "--min_replicas", "0"]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--min_replicas must be an integer >= 1, got 0" in proc.stderr


def test_a_worker_with_a_live_thread_pool_exits():
    """torchft's Manager keeps a ThreadPoolExecutor: hasten's worker joins threads only after
    ``concurrent.futures`` stopped its idle workers, as the interpreter does (it waited forever)."""
    proc = launch("--num_processes", "2", SCRIPTS / "ft_pool_exit.py", timeout=90)
    assert proc.returncode == 0 and proc.stdout.count("POOL 42") == 2, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- a plain reference
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)


def _reference(steps: int, batches: list[list[int]]) -> list[float]:
    """The scripts' model and optimizer in a plain loop: step k reads the samples ``batches[k % len]``
    (the mean loss over them, as DDP's average of equal batches' mean losses)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    for k in range(steps):
        rows = batches[k % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.cat([model.weight.detach().flatten(), model.bias.detach().flatten()]).tolist()


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(p - q) for p, q in zip(a, b, strict=True))


def test_one_group_trains_alone_on_its_shard(tmp_path):
    """Group 1 of 2, alone (min_replicas=1): every step commits, ``accelerator.step`` counts them,
    it reads the second shard only, and its weights are a plain loop's over that shard."""
    proc = launch(
        "--num_processes", "1", "--ft_replica_group", "1", "--ft_num_replica_groups", "2",
        SCRIPTS / "ft_single.py", tmp_path, "6", timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "single.json").read_text())
    assert got["strategy"] == "FaultTolerantDDPStrategy" and got["gate"] == "CommitGate"
    assert got["steps"] == [1, 2, 3, 4, 5, 6]
    shard = [list(range(b * 4, b * 4 + 4)) for b in range(1, 16, 2)]  # batches 1, 3, 5, ... of batch_size 4
    assert got["seen"] == [i for rows in shard[:6] for i in rows]
    assert _max_diff(got["final"], _reference(6, shard)) < 1e-6


# ---------------------------------------------------------------------------- two groups (slow)
class _Job:
    """``hasten lighthouse`` and one ``hasten launch`` per replica group, each its own process group."""

    def __init__(self, out, min_replicas: int, **extra_env: str) -> None:
        self.out, self.port = out, free_port()
        self.env = launch_env(**extra_env)
        cmd = [sys.executable, "-m", "hasten.cli", "lighthouse", "--port", str(self.port)]
        cmd += ["--min_replicas", str(min_replicas)]
        self.lighthouse = subprocess.Popen(
            cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        line = self.lighthouse.stdout.readline()  # printed once it listens
        assert line.startswith("hasten lighthouse: "), line
        self.groups: dict[str, subprocess.Popen] = {}

    def start(self, group: int, tag: str, steps: int, pause: float, processes: int = 1) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "hasten.cli", "launch", "--num_processes", str(processes),
            "--ft_replica_group", str(group), "--ft_num_replica_groups", "2", "--ft_lighthouse", f"http://localhost:{self.port}",
            str(SCRIPTS / "ft_train.py"), str(self.out), str(steps), tag, str(pause),
        ]  # fmt: skip
        log = open(self.out / f"g{group}{tag}.log", "w")  # noqa: SIM115 - closed with the process
        self.groups[f"{group}{tag}"] = p = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return p

    def progress(self, group: int) -> int:
        try:
            return int((self.out / f"progress{group}.txt").read_text() or -1)
        except (OSError, ValueError):
            return -1

    def result(self, group: int, tag: str, rank: int = 0) -> dict:
        return json.loads((self.out / f"group{group}_{tag}{f'_rank{rank}' if rank else ''}.json").read_text())

    def log(self, name: str) -> str:
        return (self.out / f"g{name}.log").read_text()[-4000:]

    def close(self) -> None:
        for p in [*self.groups.values(), self.lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is not self.lighthouse else p.kill()
                p.wait()


@pytest.mark.slow
def test_two_groups_without_faults_train_as_ddp_over_both(tmp_path):
    """init_sync=False (both build the same weights): each step averages both groups' batches, so the
    weights are a plain loop's over batches of 8 (DDP over the 2 processes); both groups agree at every step."""
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0")
    try:
        groups = [job.start(g, "a", 16, 0.0) for g in (0, 1)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=240) == 0, job.log(f"{g}a")
    finally:
        job.close()
    a, b = job.result(0, "a"), job.result(1, "a")
    assert a["steps"] == b["steps"] == list(range(1, 17))
    assert a["by_step"] == b["by_step"]
    assert not set(a["seen"]) & set(b["seen"]) and len(set(a["seen"]) | set(b["seen"])) == 64
    global_batches = [list(range(k * 8, k * 8 + 8)) for k in range(8)]
    assert _max_diff(a["final"], _reference(16, global_batches)) < 1e-5


@pytest.mark.slow
def test_two_groups_of_two_processes_train_as_ddp_over_all_four(tmp_path):
    """DDP inside each group (its own process group), torchft's manager across: the 4 processes read
    4 disjoint shards, and the weights are a plain loop's over batches of 16 on every process."""
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0")
    try:
        groups = [job.start(g, "a", 8, 0.0, processes=2) for g in (0, 1)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=300) == 0, job.log(f"{g}a")
    finally:
        job.close()
    ranks = [job.result(g, "a", r) for g in (0, 1) for r in (0, 1)]
    assert all(r["steps"] == list(range(1, 9)) for r in ranks)
    assert all(r["by_step"] == ranks[0]["by_step"] for r in ranks)
    seen = [set(r["seen"]) for r in ranks]
    assert sum(map(len, seen)) == 64 and len(set().union(*seen)) == 64  # one epoch: 4 shards, each sample once
    global_batches = [list(range(k * 16, k * 16 + 16)) for k in range(4)]
    assert _max_diff(ranks[0]["final"], _reference(8, global_batches)) < 1e-5


@pytest.mark.slow
def test_local_sgd_averages_the_groups_weights_every_sync_every_steps(tmp_path):
    """semi_sync="local_sgd" (torchft's LocalSGD, sync_every=4): each group steps alone on its shard,
    and every 4 steps the weights are averaged across the groups; against the same by hand."""
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", FT_TEST_SEMI_SYNC="local_sgd")
    try:
        groups = [job.start(g, "a", 3, 0.0) for g in (0, 1)]  # 3 syncs: 12 local steps
        for g, p in enumerate(groups):
            assert p.wait(timeout=240) == 0, job.log(f"{g}a")
    finally:
        job.close()
    a, b = job.result(0, "a"), job.result(1, "a")
    assert a["steps"] == b["steps"] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]  # the committed syncs
    assert a["final"] == b["final"]
    x, y = _data()
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for k in range(12):
        for g, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            rows = list(range(((2 * k + g) % 16) * 4, ((2 * k + g) % 16) * 4 + 4))  # group g's k-th batch
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        if k % 4 == 3:
            with torch.no_grad():
                for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
                    p0.copy_((p0 + p1) / 2)
                    p1.copy_(p0)
    reference = torch.cat([models[0].weight.detach().flatten(), models[0].bias.detach().flatten()]).tolist()
    assert _max_diff(a["final"], reference) < 1e-5


@pytest.mark.slow
def test_a_killed_group_rejoins_heals_and_both_finish(tmp_path):
    """Group 1 SIGKILLed at step 8 and started again: group 0 commits on alone meanwhile, the new
    group 1 heals from it (its first committed step is its peer's, not 1), the weights of both are
    equal at every step they share after, and both finish at the step the test names once it rejoined."""
    job = _Job(tmp_path, min_replicas=1)
    try:
        first, victim = job.start(0, "a", 0, 0.05), job.start(1, "a", 0, 0.05)  # 0: until OUT/target
        _wait_for(lambda: job.progress(1) >= 8, victim, job, "1a")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        at_kill = job.progress(0)
        (tmp_path / "progress1.txt").unlink()
        again = job.start(1, "b", 0, 0.05)
        _wait_for(lambda: job.progress(1) >= 1, again, job, "1b")
        alone = job.progress(0) - at_kill  # steps group 0 committed while group 1 was down
        (tmp_path / "target").write_text(str(job.progress(0) + 20))
        assert first.wait(timeout=300) == 0, job.log("0a")
        assert again.wait(timeout=300) == 0, job.log("1b")
    finally:
        job.close()
    a, b = job.result(0, "a"), job.result(1, "b")
    target = int((tmp_path / "target").read_text())
    assert a["steps"][-1] == b["steps"][-1] == target
    rejoined = b["steps"][0]
    assert rejoined > at_kill + 1 and alone > 1, (rejoined, at_kill, alone)  # healed to its peer's step
    assert b["steps"] == list(range(rejoined, target + 1))  # not from the start again; then every step
    assert all(a["by_step"][k] == b["by_step"][k] for k in b["by_step"])  # equal weights at every common step
    assert a["final"] == b["final"]
    print(f"group 0 committed {alone} steps alone; group 1 rejoined at step {rejoined}; both ended at {target}")


def _wait_for(condition, process: subprocess.Popen, job: _Job, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, job.log(name)
        time.sleep(0.05)
