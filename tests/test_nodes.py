"""Two launches as two nodes of this machine (c10d rendezvous on 127.0.0.1): a node lost, a node joining.

Each node is one ``hasten launch --nnodes 1:2 --nproc_per_node 1 --rdzv_backend c10d ...`` of
tests/scripts/nodes_train.py, which trains one epoch of 96 shuffled sample indices (batches of
2 per process) in the documented resume-or-start loop, checkpoints every 4 steps, sets the
process-group timeout to 20 s and logs, per worker process, the samples of every step and each
checkpoint it saved. Node A starts first and hosts the rendezvous store; node B is the one lost
or joining.

What "every sample once" means here: the samples the checkpoint that the last attempt resumed
from holds as trained (those its saving attempt trained before saving it, plus, recursively,
those of the checkpoint that attempt had resumed from), together with the samples trained after
the resume, are each of the 96 samples exactly once. The sizes are chosen so that
``even_batches`` adds no padding (an even number of batches is left at 2 processes). What a lost
node's attempt trained after its last checkpoint is not in that checkpoint: those samples are
trained again after the resume, as they must be (the weights that saw them were lost).

These tests take 25-60 s each on two busy cores: marked slow, they run with ``make test-slow``.
``make test`` has the fast checks of the launcher behaviour they rely on (test_cli.py: script
arguments past torch's parser, a worker dying with its launcher; test_elastic.py: a fresh
worker store per rendezvous round, no port refusal for a second node of one machine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from launch_utils import SCRIPTS, free_port, launch_env, start_launch

SAMPLES, BATCH, SAVE_EVERY, PG_TIMEOUT = 96, 2, 4, 20
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
WAIT = 240  # seconds, the most any one wait of these tests may take


# ---------------------------------------------------------------------- helpers


class Nodes:
    """The launchers of one test, each in a session of its own; all killed at the end, whatever happened."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.port = free_port()
        self.launchers: dict[str, subprocess.Popen] = {}
        self.files: list = []

    def start(self, name: str, *script_args: object) -> subprocess.Popen:
        output = open(self.out / f"{name}.out", "w")  # noqa: SIM115 - closed in stop()
        self.files.append(output)
        self.launchers[name] = start_launch(
            "--cpu", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{self.port}", "--max_restarts", "3", "--monitor_interval", "0.5",
            "--rdzv_conf", RDZV_CONF, "--log_dir", self.out / f"logs_{name}",
            SCRIPTS / "nodes_train.py", self.out, "--node", name, "--samples", SAMPLES, "--batch", BATCH,
            "--save_every", SAVE_EVERY, "--pg_timeout", PG_TIMEOUT, "--sleep", 0.3, *script_args,
            env=launch_env(), stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        return self.launchers[name]

    def output(self, name: str) -> str:
        return (self.out / f"{name}.out").read_text(errors="replace")

    def wait_until(self, what: str, check, running: tuple[str, ...] = ()) -> None:
        """Poll ``check()`` until true; fail if ``WAIT`` s pass or a launcher in ``running`` exits."""
        deadline = time.monotonic() + WAIT
        while not check():
            for name in running:
                code = self.launchers[name].poll()
                assert code is None, f"node {name} exited ({code}) before {what}:\n{self.output(name)[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} after {WAIT} s"
            time.sleep(0.2)

    def wait_exit(self, name: str) -> int:
        try:
            return self.launchers[name].wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {name} did not finish in {WAIT} s:\n{self.output(name)[-4000:]}")

    def stop(self) -> None:
        pids = {w["pid"] for w in workers(self.out)}
        for launcher in self.launchers.values():
            pids.add(launcher.pid)
        for pid in pids:  # launchers and workers lead sessions (and process groups) of their own
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for launcher in self.launchers.values():
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
                pass
        for f in self.files:
            f.close()


@pytest.fixture
def nodes(tmp_path):
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.stop()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def workers(out: Path) -> list[dict]:
    """One dict per worker process: its start event's fields and its events (whole lines only)."""
    found = []
    for path in sorted(out.glob("log_*.jsonl")):
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # the line being written
                break
        if events and events[0]["event"] == "start":
            found.append({**events[0], "events": events})
    return found


def groups(out: Path) -> dict[tuple[int, int | None], list[dict]]:
    """The attempts of the worker group: workers by (world size, checkpoint resumed from), by rank."""
    by: dict[tuple[int, int | None], list[dict]] = {}
    for w in workers(out):
        by.setdefault((w["world"], w["resumed"]), []).append(w)
    for key, ws in by.items():
        ranks = sorted(w["rank"] for w in ws)
        assert ranks == sorted(set(ranks)), f"two attempts of {key} (world size, resumed from): {ranks}"
    return by


def trained(w: dict, until_saved: int | None = None) -> list[int]:
    """The samples of a worker's steps (before it logged ``saved until_saved``, when given)."""
    out = []
    for e in w["events"]:
        if e["event"] == "saved" and e["iteration"] == until_saved:
            break
        if e["event"] == "step":
            out += e["indices"]
    return out


def committed(by: dict, n: int | None) -> list[int]:
    """The samples checkpoint_n holds as trained (see the module's docstring)."""
    if n is None:
        return []
    savers = [key for key, ws in by.items() if any(e.get("iteration") == n for w in ws for e in w["events"])]
    if not savers:  # saved, but every rank was stopped before it could log it: the group that was saving
        savers = [key for key, ws in by.items() if any(w["events"][-1]["event"] == "saving" for w in ws)]
    assert len(savers) == 1, f"which attempt saved checkpoint_{n}? {savers}"
    key = savers[0]
    return committed(by, key[1]) + [i for w in by[key] for i in trained(w, until_saved=n)]


def steps_after_save(ws: list[dict]) -> int:
    """Steps the group's workers logged after their first save."""
    count = 0
    for w in ws:
        seen = False
        for e in w["events"]:
            seen = seen or e["event"] == "saved"
            count += seen and e["event"] == "step"
    return count


# ---------------------------------------------------------------------- two nodes


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_lost_node_the_other_resumes_alone_with_every_sample_once(nodes, how):
    """Node B is lost mid-epoch while both train at world size 2, after a checkpoint.

    kill: SIGKILL to B's launcher alone (its agent); its worker dies with it, A's collective
    fails at once (the connection closes). freeze: SIGSTOP to all of B, a machine that stops
    answering: A's collective fails after the 20 s process-group timeout the script set (not
    torch's default 30 minutes), and B's rendezvous heartbeats stop. Either way A's agent
    restarts its worker, the rendezvous closes without B (its heartbeats expired) and A
    resumes alone from the newest complete checkpoint and finishes the epoch. The samples B
    and A trained after that checkpoint and before the loss are trained again.
    """
    out = nodes.out
    nodes.start("A")
    nodes.wait_until("rendezvous store of node A", lambda: port_open(nodes.port), running=("A",))
    nodes.start("B")

    def trained_on_after_a_save() -> bool:
        ws = groups(out).get((2, None), [])
        return len(ws) == 2 and steps_after_save(ws) >= 2

    nodes.wait_until("step after a checkpoint at world size 2", trained_on_after_a_save, running=("A", "B"))
    by = groups(out)
    b_worker = next(w for w in by[(2, None)] if w["node"] == "B")
    # A started first: its agent's pid is lower, so torch's rendezvous makes it group rank 0 (rank 0's
    # worker holds the checkpoint folder's lock, which a frozen B would otherwise keep)
    assert next(w for w in by[(2, None)] if w["node"] == "A")["rank"] == 0
    lost_at = time.time()
    if how == "kill":
        os.killpg(nodes.launchers["B"].pid, signal.SIGKILL)  # the launcher's group: the agent only
        _, alive = psutil.wait_procs([psutil.Process(b_worker["pid"])], timeout=60)
        assert alive == [], "node B's worker outlived its launcher"
    else:
        for pid in (nodes.launchers["B"].pid, b_worker["pid"]):
            os.killpg(pid, signal.SIGSTOP)

    assert nodes.wait_exit("A") == 0, nodes.output("A")[-6000:]
    by = groups(out)
    ((key, after),) = [(k, ws) for k, ws in by.items() if k[0] == 1]
    assert [w["node"] for w in after] == ["A"] and after[0]["restart"] >= 1  # a restart after a failure
    assert after[0]["t"] > lost_at and after[0]["events"][-1]["event"] == "done"
    assert not any(e["event"] == "done" for w in by[(2, None)] for e in w["events"])  # lost mid-epoch
    resumed = key[1]
    assert resumed is not None
    before, later = committed(by, resumed), trained(after[0])
    assert later, "nothing was left to train after the resume"
    assert sorted(before + later) == list(range(SAMPLES))
    replayed = set(i for w in by[(2, None)] for i in trained(w)) - set(before)
    assert replayed <= set(later)
    if how == "freeze":  # the first attempt's worker failed on the script's process-group timeout
        text = nodes.output("A").lower()
        assert "timed out" in text and f"{PG_TIMEOUT * 1000}ms" in text, nodes.output("A")[-6000:]


@pytest.mark.slow
def test_a_joining_node_restarts_the_group_at_two_with_every_sample_once(nodes):
    """Node A trains alone (--nnodes 1:2), checkpoints, and waits after 8 steps (a pause the join
    ends); node B starts: both agents rendezvous again, the group restarts at world size 2 and
    resumes from the newest checkpoint; both finish the epoch and exit 0."""
    out = nodes.out
    nodes.start("A", "--hold_after", 2 * SAVE_EVERY)
    nodes.wait_until(
        "pause of node A alone",
        lambda: any(e["event"] == "hold" for w in workers(out) for e in w["events"]),
        running=("A",),
    )
    nodes.start("B")
    assert nodes.wait_exit("A") == 0, nodes.output("A")[-6000:]
    assert nodes.wait_exit("B") == 0, nodes.output("B")[-6000:]
    by = groups(out)
    alone = by.pop((1, None))
    ((key, both),) = by.items()
    assert key[0] == 2 and sorted((w["node"], w["rank"]) for w in both) == [("A", 0), ("B", 1)]
    assert key[1] == max(e["iteration"] for e in alone[0]["events"] if e["event"] == "saved")  # the newest
    assert all(w["events"][-1]["event"] == "done" for w in both)
    before, later = committed({(1, None): alone, **by}, key[1]), [i for w in both for i in trained(w)]
    assert before == trained(alone[0]) and len(before) == 2 * SAVE_EVERY * BATCH  # nothing trained after the save
    assert sorted(before + later) == list(range(SAMPLES))
