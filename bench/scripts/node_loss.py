"""Row 10: seconds from a node's loss to training again at the smaller size.

Two launches as two nodes of this machine, as tests/test_nodes.py does: each ``hasten launch
--cpu --nnodes 1:2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT
--max_restarts 3 --monitor_interval 0.5 --rdzv_conf last_call_timeout=2,keep_alive_interval=1,
keep_alive_max_attempt=3`` of this script's worker (``--worker``): the documented resume-or-start
loop of a tiny model (``ProjectConfiguration(automatic_checkpoint_naming=True)``,
``load_state(missing_ok=True)``, a checkpoint every 2 steps,
``InitProcessGroupKwargs(timeout=...)``). Node A starts first and hosts the rendezvous; once
both train at world size 2 and a checkpoint exists, node B is lost:

- kill: SIGKILL to B's launcher (its worker dies with it): A's next collective fails at once;
- freeze (``--freeze-rounds``): SIGSTOP to B's launcher and worker, a machine that stops
  answering: A's collective fails only after the process-group timeout (``--timeouts``, one
  series per value, so that the timeout's share shows).

Measured per round: from the loss to the end of A's first training step at world size 1, and
its parts, from the worker's own timestamps: to the restarted worker's start (the failure seen
by A's worker, A's agent stopping it, the rendezvous closing without B once its heartbeats are
1 s x 3 overdue plus the 2 s last call, the new process), the worker's start (imports, process
group, ``prepare``, ``load_state``), the first step. Steps sleep 0.2 s at world size 2 (so the
loss lands mid-epoch) and not at world size 1. Median and quartiles over the rounds; the
driver writes the result.
"""

from __future__ import annotations

import time

T_BEGIN = time.time()  # the worker's start, before its imports

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
WAIT = 240.0


# ---------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hasten import Accelerator, InitProcessGroupKwargs, ProjectConfiguration

    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=os.path.join(args.out, "project"), automatic_checkpoint_naming=True, total_limit=2
        ),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.pg_timeout))],
    )
    torch.manual_seed(0)
    n = 512
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=2, shuffle=True))
    resumed = acc.load_state(missing_ok=True)
    world = acc.num_processes
    path = os.path.join(args.out, f"log_{args.node}_w{world}_p{os.getpid()}.jsonl")

    def log(event: str, **fields: object) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, **fields, "t": time.time()}) + "\n")

    log("start", node=args.node, world=world, pid=os.getpid(), begin=T_BEGIN, resumed=resumed is not None)
    steps = 0
    for _ in range(loader.epoch, 1):
        for x, y in loader:
            if world > 1:
                time.sleep(0.2)
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            log("step")
            steps += 1
            if steps % 2 == 0:
                acc.save_state()
                log("saved")


# ---------------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def launch_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "TORCHELASTIC_", "PET_")) and k not in drop
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def workers(out: str) -> list[dict]:
    found = []
    for path in sorted(glob.glob(os.path.join(out, "log_*.jsonl"))):
        events = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:  # the line being written
                    break
        if events and events[0]["event"] == "start":
            found.append({**events[0], "events": events})
    return found


def one_round(how: str, pg_timeout: float, base: str) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix=f"{how}-", dir=base)
    port = free_port()
    launchers: dict[str, subprocess.Popen] = {}  # the ones expected to keep running
    started: list[subprocess.Popen] = []  # all of them, killed at the end

    def start(name: str) -> None:
        cmd = [
            sys.executable, "-m", "hasten.cli", "launch", "--cpu", "--nnodes", "1:2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--max_restarts", "3",
            "--monitor_interval", "0.5", "--rdzv_conf", RDZV_CONF, "--log_dir", os.path.join(out, f"logs_{name}"),
            os.path.abspath(__file__), "--worker", "--out", out, "--node", name, "--pg-timeout", str(pg_timeout),
        ]  # fmt: skip
        with open(os.path.join(out, f"{name}.out"), "w") as output:
            launchers[name] = subprocess.Popen(
                cmd, env=launch_env(), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(launchers[name])

    def wait_until(what: str, check) -> None:
        deadline = time.monotonic() + WAIT
        while not check():
            for name, p in launchers.items():
                if p.poll() is not None:
                    tail = open(os.path.join(out, f"{name}.out"), errors="replace").read()[-3000:]
                    raise RuntimeError(f"node {name} exited ({p.returncode}) before {what}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {WAIT:.0f} s")
            time.sleep(0.05)

    def training_at_two() -> bool:
        ws = [w for w in workers(out) if w["world"] == 2]
        return (
            len(ws) == 2
            and all(sum(e["event"] == "step" for e in w["events"]) >= 3 for w in ws)
            and any(e["event"] == "saved" for w in ws for e in w["events"])
        )

    def alone() -> list[dict]:
        return [w for w in workers(out) if w["world"] == 1 and any(e["event"] == "step" for e in w["events"])]

    try:
        start("A")
        wait_until("rendezvous store of node A", lambda: port_open(port))
        start("B")
        wait_until("training at world size 2 after a checkpoint", training_at_two)
        b_worker = next(w["pid"] for w in workers(out) if w["world"] == 2 and w["node"] == "B")
        lost = time.time()
        if how == "kill":
            os.killpg(launchers["B"].pid, signal.SIGKILL)
        else:
            for pid in (launchers["B"].pid, b_worker):
                os.killpg(pid, signal.SIGSTOP)
        launchers.pop("B")  # expected to be gone (or frozen) from now on
        wait_until("first step at world size 1", lambda: bool(alone()))
        (w,) = alone()
        first_step = next(e["t"] for e in w["events"] if e["event"] == "step")
        if not w["resumed"]:
            raise RuntimeError("the worker at world size 1 started without a checkpoint")
        return {
            "total": first_step - lost,
            "to_restart": w["begin"] - lost,
            "startup": w["t"] - w["begin"],
            "first_step": first_step - w["t"],
        }
    finally:
        pids = {w["pid"] for w in workers(out)} | {p.pid for p in started}
        for pid in pids:  # launchers and workers lead process groups of their own (SIGKILL ends a stopped one too)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in started:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="(internal) run as a node's worker")
    p.add_argument("--node", default="A")
    p.add_argument("--pg-timeout", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the kill")
    p.add_argument("--freeze-rounds", type=int, default=2, help="rounds of the freeze, for each timeout")
    p.add_argument("--timeouts", default="10,20", help="process-group timeouts of the kill (the first) and the freeze")
    p.add_argument("--out")
    p.add_argument("--no-others", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _harness import emit, summary

    timeouts = [float(t) for t in args.timeouts.split(",")]
    base = tempfile.mkdtemp(prefix="hasten-node-loss-")
    series: list[tuple[str, float, int]] = [("kill", timeouts[0], args.rounds)]
    series += [("freeze", t, args.freeze_rounds) for t in timeouts if args.freeze_rounds > 0]
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(max(n for _, _, n in series)):  # the series interleaved, round by round
            for how, timeout, n in series if r % 2 == 0 else series[::-1]:
                if r < n:
                    got = one_round(how, timeout, base)
                    key = "kill" if how == "kill" else f"freeze_{timeout:g}"
                    for part, value in got.items():
                        figures.setdefault(key, {}).setdefault(part, []).append(value)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    emit({
        "config": {
            "nodes": 2, "processes_per_node": 1, "rdzv_conf": RDZV_CONF, "monitor_interval": 0.5,
            "kill_pg_timeout_s": timeouts[0], "save_every_steps": 2,
        },
        "kill": {part: summary(v) for part, v in figures["kill"].items()},
        "freeze": {key.split("_", 1)[1]: {part: summary(v) for part, v in parts.items()}
                   for key, parts in figures.items() if key.startswith("freeze_")},
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
