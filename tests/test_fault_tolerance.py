"""Training through failures: FaultToleranceKwargs on torchft (hasten.strategies.fault_tolerance).

Fast: the handler's checks, an unreachable lighthouse (every rank of a 2-process group gets the
error), the refusals, and one replica group training alone through ``hasten launch`` (commits,
data shard, weights against a plain loop).
Slow: two and three replica groups and ``hasten lighthouse``, all real processes on gloo: no
faults (the weights of DDP over every group); one group SIGKILLed mid-run and restarted (the other
keeps committing, the rejoined group heals to its peer's weights at every common step, both
finish, its RNG states its peer's); a group SIGKILLed while another heals; LocalSGD and
(Streaming) DiLoCo against the same algorithms by hand; fp16's skipped step skipped on every
group; a resume after a full stop exact, from one folder that one group wrote or a folder each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from launch_utils import SCRIPTS, free_port, launch, launch_env

pytest.importorskip("torchft")

from hasten import Accelerator, FaultToleranceKwargs  # noqa: E402
from hasten.checkpoint.errors import CheckpointError  # noqa: E402
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
        ({"fragments": 2, "semi_sync": "local_sgd"}, ValueError, "fragments=2 needs semi_sync='diloco'"),
        ({"fragments": 0}, ValueError, "fragments must be >= 1"),
        ({"semi_sync": "diloco", "sync_every": 6, "fragments": 4}, ValueError, "sync_every=6 must be a multiple of"),
        ({"outer_lr": 0}, ValueError, "outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, ValueError, "outer_momentum must be >= 0 and < 1"),
        ({"outer_momentum": 0.0}, ValueError, "outer_nesterov=True needs outer_momentum > 0"),
        ({"outer_nesterov": 1}, TypeError, "outer_nesterov"),
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


def test_unreachable_lighthouse_fails_every_rank_of_a_group(tmp_path):
    """A group of 2 processes: rank 0 reaches for the lighthouse (connect_timeout=2 s), rank 1 waits
    for it; both get the ConnectionError naming the address (not rank 1 waiting on the group's
    store until the launcher kills it)."""
    address = f"http://127.0.0.1:{free_port()}"
    proc = launch("--num_processes", "2", SCRIPTS / "ft_unreachable.py", tmp_path, address, timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):
        got = (tmp_path / f"rank{rank}.txt").read_text()
        assert got.startswith(f"ConnectionError: FaultToleranceKwargs.lighthouse '{address}' cannot be reached"), got
    assert "raised on rank 0 of replica group 0" in (tmp_path / "rank1.txt").read_text()


@pytest.mark.filterwarnings("ignore:mixed_precision='fp16' on the CPU")
def test_refusals_come_before_the_lighthouse_is_reached():
    from hasten import FullyShardedDataParallelPlugin

    address = f"http://127.0.0.1:{free_port()}"  # never reached: each refusal comes first
    with pytest.raises(ValueError, match=r"FaultToleranceKwargs with Accelerator\(fsdp_plugin=...\) is not supported"):
        Accelerator(
            kwargs_handlers=[FaultToleranceKwargs(lighthouse=address)], fsdp_plugin=FullyShardedDataParallelPlugin()
        )
    with pytest.raises(ValueError, match=r"FaultToleranceKwargs\(semi_sync='diloco'\) with mixed_precision='fp16'"):
        handler = FaultToleranceKwargs(lighthouse=address, semi_sync="diloco")
        Accelerator(mixed_precision="fp16", kwargs_handlers=[handler])
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


# ---------------------------------------------------------------------------- save_state's one writer
class _Groups:
    """A FaultTolerance as ``checkpoint.replica_groups`` sees it: ``answers`` are what each
    exchange gets from the other groups (this group's own message put in at its ``None``)."""

    def __init__(self, group: int, answers: list[list], safe: bool = True, participating: int = 0) -> None:
        self.handler = SimpleNamespace(replica_group=group, num_replica_groups=2)
        self.manager = SimpleNamespace(participating_rank=lambda: participating)
        self.step, self.saved_groups, self.safe = 5, None, safe
        self.answers, self.sent, self.written = answers, [], []

    def check_savable(self) -> None:  # no fragment's all-reduce in flight (test_fault_tolerance_options.py)
        return None

    def exchange_is_safe(self) -> bool:
        return self.safe

    def exchange(self, mine: dict) -> list[dict]:
        self.sent.append(mine)
        return [mine if t is None else t for t in self.answers.pop(0)]

    def ctx(self) -> SimpleNamespace:
        state = SimpleNamespace(process_index=0, is_main_process=True)
        return SimpleNamespace(
            fault_tolerance=self, state=state, registry=SimpleNamespace(dataloaders=[]), agree=lambda what, fn: fn()
        )

    def write(self) -> None:
        self.written.append(dict(self.saved_groups))


def _told(group: int, target: str, step: int = 5, asynchronous: bool = False) -> dict:
    return {"group": group, "target": target, "async": asynchronous, "step": step, "state": {"rank": 0}}


def test_one_group_writes_a_shared_folder_with_every_groups_states(tmp_path):
    from hasten.checkpoint import replica_groups
    from hasten.checkpoint.manifest import MANIFEST

    target = str(tmp_path / "ckpt")
    writer = _Groups(0, [[None, _told(1, target)], [None, {"group": 1, "done": None}]])
    replica_groups.save_once(writer.ctx(), target, False, writer.write)
    assert [sorted(w) for w in writer.written] == [[0, 1]] and writer.saved_groups is None
    assert writer.sent[1] == {"group": 0, "done": "ok"}  # then it tells the others it wrote
    other = _Groups(1, [[_told(0, target), None], [{"group": 0, "done": "ok"}, None]])
    with pytest.raises(CheckpointError, match="does not see it: the groups share no filesystem there"):
        replica_groups.save_once(other.ctx(), target, False, other.write)  # no manifest there: not shared
    os.makedirs(target)
    open(os.path.join(target, MANIFEST), "w").close()
    other = _Groups(1, [[_told(0, target), None], [{"group": 0, "done": "ok"}, None]])
    replica_groups.save_once(other.ctx(), target, False, other.write)
    assert other.written == [] and len(other.sent) == 2


def test_a_writers_failure_is_raised_on_every_group(tmp_path):
    from hasten.checkpoint import replica_groups

    target = str(tmp_path / "ckpt")
    writer = _Groups(0, [[None, _told(1, target)], [None, {"group": 1, "done": None}]])

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replica_groups.save_once(writer.ctx(), target, False, fail)
    assert writer.sent[1]["done"].startswith("OSError: [Errno 28] No space left")
    other = _Groups(1, [[_told(0, target), None], [writer.sent[1], None]])
    with pytest.raises(CheckpointError, match=r"replica group 0, which writes .* failed: OSError: \[Errno 28\]"):
        replica_groups.save_once(other.ctx(), target, False, other.write)


def test_groups_with_folders_of_their_own_each_write_theirs(tmp_path):
    from hasten.checkpoint import replica_groups

    group = _Groups(1, [[_told(0, str(tmp_path / "a")), None], [{"group": 0, "done": "ok"}, None]])
    replica_groups.save_once(group.ctx(), str(tmp_path / "b"), False, group.write)
    assert [sorted(w) for w in group.written] == [[0, 1]]


def test_an_asynchronous_save_anywhere_skips_the_writers_word(tmp_path):
    from hasten.checkpoint import replica_groups

    target = str(tmp_path / "ckpt")
    other = _Groups(1, [[_told(0, target, asynchronous=True), None]])
    replica_groups.save_once(other.ctx(), target, False, other.write)  # returns at once: no manifest checked
    assert other.written == [] and len(other.sent) == 1


def test_saves_at_different_steps_are_refused_with_nothing_written(tmp_path):
    from hasten.checkpoint import replica_groups

    target = str(tmp_path / "ckpt")
    writer = _Groups(0, [[None, _told(1, target, step=4)]])
    with pytest.raises(ValueError, match=r"different committed steps in the replica groups \(\{0: 5, 1: 4\}"):
        replica_groups.save_once(writer.ctx(), target, False, writer.write)
    assert writer.written == [] and not tmp_path.joinpath("ckpt").exists()


@pytest.mark.parametrize("participating", [0, 1])
def test_a_group_joining_at_the_save_leaves_the_process_group_alone(tmp_path, participating):
    """A group joined the quorum started after the step (zero_grad before save_state): no exchange;
    torchft's participating rank 0 writes with its own states only, the other nothing; both warn."""
    from hasten.checkpoint import replica_groups

    group = _Groups(1, [], safe=False, participating=participating)
    with pytest.warns(UserWarning, match="a replica group joined the quorum started after this step"):
        replica_groups.save_once(group.ctx(), str(tmp_path / "ckpt"), False, group.write)
    assert group.sent == [] and [sorted(w) for w in group.written] == ([[1]] if participating == 0 else [])


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
    # its save_state (also one before the first step, which starts the first quorum) holds its own
    # group's positions; group 0, which the folder lacks, continues group 1's, with a warning
    assert (got["saved_groups"], got["writer"]) == ([1], 1)
    [warning] = got["warnings"]
    assert "holds the positions of replica groups [1], not of this group 0" in warning
    assert "continues replica group 1's dataloader positions" in warning
    assert got["next"] == shard[6]


# ---------------------------------------------------------------------------- two groups (slow)
class _Job:
    """``hasten lighthouse`` and one ``hasten launch`` per replica group, each its own process group."""

    def __init__(self, out, min_replicas: int, groups: int = 2, **extra_env: str) -> None:
        self.out, self.port, self.num_groups = out, free_port(), groups
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
            "--ft_replica_group", str(group), "--ft_num_replica_groups", str(self.num_groups), "--ft_lighthouse", f"http://localhost:{self.port}",
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


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([model.weight.detach().flatten(), model.bias.detach().flatten()]).tolist()


def _semi_sync_reference(kind: str, steps: int, sync_every: int, fragments: int = 1) -> list[list[float]]:
    """Two groups by hand, as torchft's LocalSGD / (Streaming) DiLoCo do it: group g's k-th batch is
    batch 2k+g; LocalSGD averages the weights every ``sync_every`` steps; DiLoCo, every
    ``sync_every / fragments`` steps, takes fragment (syncs so far % fragments), averages its
    pseudo-gradient (its weights at the last sync less each group's now), and steps an outer SGD
    (lr 0.7, Nesterov momentum 0.9) from the last synced weights with it. Group 0's weights after each step."""
    x, y = _data()
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    inner = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    names = [n for n, _ in models[0].named_parameters()]  # Linear: the weight, the bias (a fragment each at 2)
    pieces = [names] if fragments == 1 else [[n] for n in names]
    synced = {n: p.detach().clone().requires_grad_() for n, p in models[0].named_parameters()}
    outer = [torch.optim.SGD([synced[n] for n in piece], lr=0.7, momentum=0.9, nesterov=True) for piece in pieces]
    every, syncs, trace = sync_every // fragments, 0, []
    for k in range(steps):
        for g, (model, optimizer) in enumerate(zip(models, inner, strict=True)):
            rows = list(range(((2 * k + g) % 16) * 4, ((2 * k + g) % 16) * 4 + 4))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        if (k + 1) % every == 0:
            params = [dict(m.named_parameters()) for m in models]
            with torch.no_grad():
                if kind == "local_sgd":
                    for n in names:
                        params[0][n].copy_((params[0][n] + params[1][n]) / 2)
                        params[1][n].copy_(params[0][n])
                else:
                    f = syncs % fragments
                    for n in pieces[f]:
                        synced[n].grad = synced[n] - (params[0][n] + params[1][n]) / 2
                    outer[f].step()
                    for n in pieces[f]:
                        params[0][n].copy_(synced[n])
                        params[1][n].copy_(synced[n])
            syncs += 1
        trace.append(_flat(models[0]))
    return trace


def _run_semi_sync(tmp_path, kind: str, syncs: int, **extra: str) -> tuple[dict, dict]:
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", FT_TEST_SEMI_SYNC=kind, **extra)
    try:
        groups = [job.start(g, "a", syncs, 0.0) for g in (0, 1)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=240) == 0, job.log(f"{g}a")
    finally:
        job.close()
    return job.result(0, "a"), job.result(1, "a")


@pytest.mark.slow
def test_local_sgd_averages_the_groups_weights_every_sync_every_steps(tmp_path):
    """semi_sync="local_sgd" (torchft's LocalSGD, sync_every=4): each group steps alone on its shard,
    and every 4 steps the weights are averaged across the groups; against the same by hand."""
    a, b = _run_semi_sync(tmp_path, "local_sgd", 3)  # 3 syncs: 12 local steps
    assert a["steps"] == b["steps"] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]  # the committed syncs
    assert a["final"] == b["final"]
    reference = _semi_sync_reference("local_sgd", 12, 4)
    assert max(_max_diff(p, q) for p, q in zip(a["trace"], reference, strict=True)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_steps_the_outer_optimizer_only_at_each_sync(tmp_path, fragments):
    """semi_sync="diloco" (torchft's DiLoCo, sync_every=4; 2 fragments: Streaming DiLoCo, one
    fragment every 2 steps, in turn): between syncs each group follows its inner SGD alone, at each
    sync the synced weights are equal in both groups and are the outer step's; against the same
    by hand at every step."""
    a, b = _run_semi_sync(tmp_path, "diloco", 3, FT_TEST_SYNC_EVERY="4", FT_TEST_FRAGMENTS=str(fragments))
    every = 4 // fragments
    assert a["steps"] == b["steps"] == [k // every for k in range(1, 3 * every + 1)]
    reference = _semi_sync_reference("diloco", 3 * every, 4, fragments)
    assert max(_max_diff(p, q) for p, q in zip(a["trace"], reference, strict=True)) < 1e-5
    weight = 32  # Linear(8, 4): 32 weights, then 4 biases
    for k in range(every - 1, 3 * every, every):  # the steps that synced: fragment (sync % fragments) equal
        f = (k // every) % fragments
        part = slice(0, 36) if fragments == 1 else (slice(0, weight) if f == 0 else slice(weight, 36))
        assert a["trace"][k][part] == b["trace"][k][part], k
    assert a["trace"][0] != b["trace"][0]  # not synced after the first step: the groups trained apart


@pytest.mark.slow
@pytest.mark.parametrize(("semi_sync", "shared"), [("", True), ("", False), ("diloco", True)])
def test_a_resume_after_a_full_stop_is_exact(tmp_path, semi_sync, shared):
    """Two groups save_state at committed step 2 and train on to 4; then both stop and start again
    from the checkpoint: the committed step goes on from 2 (torchft's step is in the checkpoint),
    and every step after it has the uninterrupted run's weights, batches and random draws (with
    DiLoCo: its position in the sync cycle, outer momentum and last synced weights too). Group 1
    is one batch and one draw ahead of group 0, so each must take its own position and generators
    back. One folder for both (``shared``): group 0 alone writes it, with both groups' states;
    a folder each (saved before ``zero_grad``, so before the next step's quorum): each group writes
    its own, each with both groups' states."""
    extra = {"FT_TEST_SEMI_SYNC": semi_sync, "FT_TEST_SYNC_EVERY": "2"} if semi_sync else {}
    extra |= {"FT_TEST_SHARED": "1"} if shared else {"FT_TEST_SAVE_EARLY": "1"}  # before zero_grad: no new quorum
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", FT_TEST_SAVE_AT="2", FT_TEST_OFFSET="1", **extra)
    try:
        for tag, env_tag in (("a", {}), ("b", {"FT_TEST_RESUME": "1", "FT_TEST_SAVE_AT": "-1"})):
            job.env.update(env_tag)
            groups = [job.start(g, tag, 4, 0.0) for g in (0, 1)]
            for g, p in enumerate(groups):
                assert p.wait(timeout=240) == 0, job.log(f"{g}{tag}")
    finally:
        job.close()
    wrote = sorted(f.name for f in tmp_path.glob("wrote*"))
    assert wrote == (["wrote0_0"] if shared else ["wrote0_0", "wrote1_0"])  # run b saved nothing
    for folder in ["ckpt"] if shared else ["ckpt0", "ckpt1"]:
        saved = torch.load(tmp_path / folder / "fault_tolerance_groups_0.pt", weights_only=True)
        assert saved["writer"] == (0 if shared else int(folder[-1])) and sorted(saved["groups"]) == [0, 1]
        positions = [saved["groups"][g]["dataloaders"] for g in (0, 1)]
        assert positions[0] != positions[1]  # group 1 is a batch ahead
    per_step = 2 if semi_sync else 1  # local steps per committed step
    a_runs = [job.result(g, "a") for g in (0, 1)]
    assert a_runs[0]["seen"][:4] == [0, 1, 2, 3] and a_runs[1]["seen"][:4] == [12, 13, 14, 15]  # 1 skipped 4..7
    assert a_runs[0]["draws"] != a_runs[1]["draws"]
    for g in (0, 1):
        a, b = a_runs[g], job.result(g, "b")
        cut = 2 * per_step  # local steps before the save
        assert b["steps"] == a["steps"][cut:] and b["steps"][0] == (2 if semi_sync else 3)  # DiLoCo: [2, 3, 3, 4]
        assert b["trace"] == a["trace"][cut:]  # exact: the same floats
        assert b["seen"] == a["seen"][cut * 4 :]
        assert b["draws"] == {k: v for k, v in a["draws"].items() if k in b["draws"]} and len(b["draws"]) >= 2


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
        # group 0 trains on alone (once the lighthouse has let the dead group go) before group 1 comes back
        _wait_for(lambda: job.progress(0) >= at_kill + 3, first, job, "0a")
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
    # the RNG states came with the heal: the same draws at every common step (a restarted group's own
    # generator, seeded again, would draw the stream's first numbers)
    assert b["draws"] and all(a["draws"][k] == b["draws"][k] for k in b["draws"])
    print(f"group 0 committed {alone} steps alone; group 1 rejoined at step {rejoined}; both ended at {target}")


@pytest.mark.slow
def test_three_groups_without_faults_train_as_ddp_over_all_three(tmp_path):
    """Three replica groups (min_replicas=3): each step averages the three groups' batches, so the
    weights are a plain loop's over batches of 12, equal in every group at every step."""
    job = _Job(tmp_path, min_replicas=3, groups=3, FT_TEST_INIT_SYNC="0")
    try:
        groups = [job.start(g, "a", 5, 0.0) for g in (0, 1, 2)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=300) == 0, job.log(f"{g}a")
    finally:
        job.close()
    results = [job.result(g, "a") for g in (0, 1, 2)]
    assert all(r["steps"] == [1, 2, 3, 4, 5] and r["trace"] == results[0]["trace"] for r in results)
    assert sorted(i for r in results for i in r["seen"]) == list(range(60))  # 3 shards of batches 3k+g
    global_batches = [list(range(k * 12, k * 12 + 12)) for k in range(5)]
    assert _max_diff(results[0]["final"], _reference(5, global_batches)) < 1e-5


@pytest.mark.slow
def test_a_group_killed_while_another_heals(tmp_path):
    """Three groups; group 2 SIGKILLed and started again; while it heals (a pause the script puts
    into its heal), group 1 is SIGKILLed too: groups 0 and 2 go on, group 2 ends healed (its steps
    go on from its peer's, equal weights at every step both have), and both finish."""
    job = _Job(tmp_path, min_replicas=1, groups=3, FT_TEST_INIT_SYNC="0", FT_TEST_HEAL_PAUSE="3")
    try:
        first, second, victim = (job.start(g, "a", 0, 0.05) for g in (0, 1, 2))
        _wait_for(lambda: job.progress(2) >= 5, victim, job, "2a")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        at_kill = job.progress(0)
        (tmp_path / "progress2.txt").unlink()
        again = job.start(2, "b", 0, 0.05)
        _wait_for(lambda: (tmp_path / "healing2").exists(), again, job, "2b")
        os.killpg(second.pid, signal.SIGKILL)  # group 1 dies during group 2's heal
        second.wait()
        _wait_for(lambda: job.progress(2) >= 1, again, job, "2b")
        (tmp_path / "target").write_text(str(job.progress(0) + 15))
        assert first.wait(timeout=300) == 0, job.log("0a")
        assert again.wait(timeout=300) == 0, job.log("2b")
    finally:
        job.close()
    a, c = job.result(0, "a"), job.result(2, "b")
    target = int((tmp_path / "target").read_text())
    assert a["steps"][-1] == c["steps"][-1] == target
    assert c["steps"][0] > at_kill, (c["steps"][0], at_kill)  # healed to its peer's step, not from 1
    assert all(a["by_step"][k] == c["by_step"][k] for k in c["by_step"])
    assert all(a["draws"][k] == c["draws"][k] for k in c["draws"])  # its generators healed too
    assert a["final"] == c["final"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:mixed_precision='fp16' on the CPU")
def test_fp16_skips_a_step_on_every_group_alike(tmp_path):
    """fp16 with two groups: group 1 alone feeds an inf at step 3; the gradients averaged across
    the groups hold it, so both groups skip that update (weights unchanged), both count the step
    as committed, both halve the loss scale, and the weights stay equal at every step."""
    job = _Job(tmp_path, min_replicas=2, FT_TEST_INIT_SYNC="0", FT_TEST_FP16="1", FT_TEST_INF_STEP="3")
    try:
        groups = [job.start(g, "a", 6, 0.0) for g in (0, 1)]
        for g, p in enumerate(groups):
            assert p.wait(timeout=240) == 0, job.log(f"{g}a")
    finally:
        job.close()
    a, b = job.result(0, "a"), job.result(1, "a")
    assert a["steps"] == b["steps"] == [1, 2, 3, 4, 5, 6]
    assert a["skipped"] == b["skipped"] == [False, False, True, False, False, False]
    assert a["scales"] == b["scales"] and a["scales"][2] == a["scales"][1] / 2
    assert a["trace"] == b["trace"] and a["trace"][2] == a["trace"][1] and a["trace"][3] != a["trace"][2]


def _wait_for(condition, process: subprocess.Popen, job: _Job, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, job.log(name)
        time.sleep(0.05)
