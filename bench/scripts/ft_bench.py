"""Live fault tolerance (FaultToleranceKwargs, torchft): what a lost replica group costs, and the step's cost.

Two figures, on this machine's CPUs (gloo), a small MLP (8 -> 64 -> 1, batch 8 per process):

- **Steps lost to one failure.** Two data-parallel replicas; at step ``--kill-at`` one of them is
  SIGKILLed (its launcher and worker) and not brought back.
  * FT: ``hasten lighthouse --min_replicas 1 --heartbeat_timeout_ms 3000`` and one
    ``hasten launch --ft_replica_group G`` per replica (1 process each). The survivor's steps that
    did not commit (``accelerator.step`` unchanged after ``optimizer.step()``) are its *failed*
    steps; its *stall* is the time from the kill to its next committed step.
  * Elastic (row 10's setting, bench/scripts/node_loss.py): two ``hasten launch --nnodes 1:2
    --max_restarts 3`` of one process each, a ``save_state`` every ``--save-every`` steps; after
    the kill the survivor's agent restarts it at world size 1 and it resumes from the last
    checkpoint: its *redone* steps are the step at the kill less the checkpoint's, its *stall*
    the time from the kill to its first step after the restart.
  Steps lost = failed (FT) or redone (elastic) + stall / the step time before the kill (each
  step sleeps ``--step-sleep`` s, the compute of a larger model, the same in both).
- **Step time with FT / plain DDP**, 2 processes: two FT replica groups of 1 process each (a
  lighthouse, ``min_replicas=2``, ``init_sync=False``) against ``hasten launch --num_processes 2``
  (DDP), no sleep; the median step of each run (the first 5 not counted), rounds interleaved
  (DDP, FT / FT, DDP), the per-round ratio summarised (median, quartiles).

``python bench/scripts/ft_bench.py [--rounds 3] [--kill-rounds 3] [--out result.json]``; the JSON
as the other scripts' (``_harness.emit``).
"""

from __future__ import annotations

import time

T_BEGIN = time.time()  # the worker's start, before its imports

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from node_loss import RDZV_CONF, free_port, launch_env, port_open  # noqa: E402

WAIT = 300.0


# ---------------------------------------------------------------------- the workers
def worker(args: argparse.Namespace) -> None:
    """One process of a run (``--worker ft|ddp|elastic``): trains and logs every step (JSON lines)."""
    from datetime import timedelta

    import torch

    from hasten import Accelerator, FaultToleranceKwargs, InitProcessGroupKwargs, ProjectConfiguration

    torch.set_num_threads(1)
    kwargs: dict = {"cpu": True}
    if args.worker == "ft":
        handler = FaultToleranceKwargs(min_replicas=args.min_replicas, init_sync=False)
        kwargs["kwargs_handlers"] = [handler]
    elif args.worker == "elastic":
        kwargs["project_config"] = ProjectConfiguration(
            project_dir=os.path.join(args.out, "project"), automatic_checkpoint_naming=True, total_limit=2
        )
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(timeout=timedelta(seconds=10))]
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
    resumed = acc.load_state(missing_ok=True) if args.worker == "elastic" else None
    name = f"{args.node}_w{acc.num_processes}_r{acc.process_index}_p{os.getpid()}"
    log_file = open(os.path.join(args.out, f"log_{name}.jsonl"), "a", encoding="utf-8")  # noqa: SIM115

    def log(event: str, **fields: object) -> None:
        log_file.write(json.dumps({"event": event, **fields, "t": time.time()}) + "\n")
        log_file.flush()

    log("start", node=args.node, world=acc.num_processes, begin=T_BEGIN, resumed=resumed is not None, step=acc.step)
    for _ in range(loader.epoch, 100):
        for x, y in loader:
            start, before = time.perf_counter(), acc.step
            if args.step_sleep:
                time.sleep(args.step_sleep)
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            log("step", step=acc.step, committed=acc.step > before, seconds=time.perf_counter() - start)
            if args.worker == "elastic" and acc.step % args.save_every == 0:
                acc.save_state()
            if args.steps and acc.step >= args.steps:
                return


# ---------------------------------------------------------------------- the driver
def events(out: str, node: str | None = None) -> list[dict]:
    """Every worker's log (a list of events each) of ``out``, those of ``node`` only where given."""
    found = []
    for path in sorted(glob.glob(os.path.join(out, "log_*.jsonl"))):
        lines = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    lines.append(json.loads(line))
                except ValueError:  # the line being written
                    break
        if lines and (node is None or lines[0]["node"] == node):
            found.append(lines)
    return found


class Run:
    """The launches of one measurement, each its own session (killed together at the end)."""

    def __init__(self, base: str, name: str) -> None:
        self.out = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str]) -> None:
        with open(os.path.join(self.out, f"{name}.out"), "w") as output:
            self.procs[name] = subprocess.Popen(
                cmd, env=launch_env(), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )

    def worker_cmd(self, launch: list[str], kind: str, node: str, args: argparse.Namespace, **extra: object) -> list:
        cmd = [sys.executable, "-m", "hasten.cli", "launch", *launch, os.path.abspath(__file__), "--worker", kind]
        cmd += ["--out", self.out, "--node", node]
        return cmd + [str(a) for k, v in extra.items() for a in (f"--{k.replace('_', '-')}", v)]

    def lighthouse(self, min_replicas: int) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "hasten.cli", "lighthouse", "--min_replicas", str(min_replicas)]
        # a group silent for 3 s is dead: the elastic runs' rendezvous drops a node after 1 s x 3 heartbeats
        self.start("lighthouse", [*cmd, "--port", str(port), "--heartbeat_timeout_ms", "3000"])
        self.wait_until("the lighthouse", lambda: port_open(port), ())
        return f"http://127.0.0.1:{port}"

    def wait_until(self, what: str, check, watched) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + WAIT
        while not check():
            for name in watched:
                if self.procs[name].poll() is not None:
                    tail = open(os.path.join(self.out, f"{name}.out"), errors="replace").read()[-3000:]
                    raise RuntimeError(f"{name} exited ({self.procs[name].returncode}) before {what}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {WAIT:.0f} s")
            time.sleep(0.02)

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def close(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


def steps_of(log: list[dict]) -> list[dict]:
    return [e for e in log if e["event"] == "step"]


def ft_loss(args: argparse.Namespace, base: str) -> dict[str, float]:
    """One FT round: group B killed at step ``kill_at``; the survivor A's failed steps and stall."""
    run = Run(base, "ft-loss")
    try:
        address = run.lighthouse(1)
        for g, node in enumerate("AB"):
            launch = ["--cpu", "--num_processes", "1", "--ft_replica_group", str(g), "--ft_num_replica_groups", "2"]
            launch += ["--ft_lighthouse", address]
            run.start(node, run.worker_cmd(launch, "ft", node, args, step_sleep=args.loss_sleep))
        at = lambda node, n: any(len(steps_of(e)) >= n for e in events(run.out, node))  # noqa: E731
        run.wait_until("both groups training", lambda: at("A", args.kill_at) and at("B", args.kill_at), "AB")
        before = steps_of(events(run.out, "A")[0])
        lost = time.time()
        run.kill("B")
        run.wait_until("10 steps of A alone", lambda: at("A", len(before) + 10), "A")
        after = [e for e in steps_of(events(run.out, "A")[0]) if e["t"] > lost]
        first = next(e for e in after if e["committed"])
        step_time = statistics.median(e["seconds"] for e in before[-10:])
        failed = sum(not e["committed"] for e in after)
        return {"failed": failed, "stall_s": first["t"] - lost, "step_s": step_time}
    finally:
        run.close()


def elastic_loss(args: argparse.Namespace, base: str) -> dict[str, float]:
    """One elastic round (node_loss.py's setting): node B killed; A restarted from the last checkpoint."""
    run = Run(base, "elastic-loss")
    port = free_port()
    try:
        for node in "AB":
            launch = ["--cpu", "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d"]
            launch += ["--rdzv_endpoint", f"127.0.0.1:{port}", "--max_restarts", "3", "--monitor_interval", "0.5"]
            launch += ["--rdzv_conf", RDZV_CONF]
            extra = {"step_sleep": args.loss_sleep, "save_every": args.save_every}
            run.start(node, run.worker_cmd(launch, "elastic", node, args, **extra))
            if node == "A":
                run.wait_until("the rendezvous store of node A", lambda: port_open(port), "A")
        two = lambda: [e for e in events(run.out) if e[0]["world"] == 2]  # noqa: E731
        run.wait_until(
            "training at world size 2", lambda: sum(len(steps_of(e)) >= args.kill_at for e in two()) == 2, "AB"
        )
        before = steps_of(next(e for e in two() if e[0]["node"] == "A"))
        step_at_kill = before[-1]["step"]
        lost = time.time()
        run.kill("B")
        alone = lambda: [e for e in events(run.out, "A") if e[0]["world"] == 1 and steps_of(e)]  # noqa: E731
        run.wait_until("a step at world size 1", lambda: bool(alone()), "A")
        log = alone()[0]
        step_time = statistics.median(e["seconds"] for e in before[-10:])
        return {"redone": step_at_kill - log[0]["step"], "stall_s": steps_of(log)[0]["t"] - lost, "step_s": step_time}
    finally:
        run.close()


def step_times(args: argparse.Namespace, base: str, kind: str) -> float:
    """The median step of a run of ``--steps`` steps: FT (2 groups of 1 process) or DDP (2 processes)."""
    run = Run(base, f"step-{kind}")
    try:
        if kind == "ddp":
            run.start("A", run.worker_cmd(["--cpu", "--num_processes", "2"], "ddp", "A", args, steps=args.steps))
        else:
            address = run.lighthouse(2)
            for g, node in enumerate("AB"):
                launch = ["--cpu", "--num_processes", "1", "--ft_replica_group", str(g)]
                launch += ["--ft_num_replica_groups", "2", "--ft_lighthouse", address]
                extra = {"steps": args.steps, "min_replicas": 2}
                run.start(node, run.worker_cmd(launch, "ft", node, args, **extra))
        for p in run.procs.values():
            if p is not run.procs.get("lighthouse") and p.wait(timeout=WAIT) != 0:
                raise RuntimeError(f"the {kind} run failed: see {run.out}")
        log = steps_of(events(run.out, "A")[0])
        return statistics.median(e["seconds"] for e in log[5:])
    finally:
        run.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["ft", "ddp", "elastic"], help="(internal) run as a worker")
    p.add_argument("--node", default="A")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=10, help="elastic: a checkpoint every N steps")
    p.add_argument("--steps", type=int, default=0, help="steps of a step-time run (0: until killed)")
    p.add_argument("--kill-at", type=int, default=25, help="the survivor's steps before the kill")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the step-time comparison")
    p.add_argument("--kill-rounds", type=int, default=3, help="rounds of each failure")
    p.add_argument("--loss-sleep", type=float, default=0.1, help="the sleep of each step in the failure rounds")
    p.add_argument("--timed-steps", type=int, default=60, help="steps of each step-time run")
    p.add_argument("--out")
    p.add_argument("--no-others", action="store_true", help="(bench/run.py's flag: no other library runs this row)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from _harness import emit, summary

    base = tempfile.mkdtemp(prefix="hasten-ft-bench-")
    try:
        losses: dict[str, list[dict[str, float]]] = {"ft": [], "elastic": []}
        for r in range(args.kill_rounds):
            for kind in ("ft", "elastic") if r % 2 == 0 else ("elastic", "ft"):
                losses[kind].append((ft_loss if kind == "ft" else elastic_loss)(args, base))
        args.steps = args.timed_steps
        times: dict[str, list[float]] = {"ddp": [], "ft": []}
        for r in range(args.rounds):
            for kind in ("ddp", "ft") if r % 2 == 0 else ("ft", "ddp"):
                times[kind].append(step_times(args, base, kind))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def lost(rounds: list[dict[str, float]], key: str) -> dict:
        parts = {k: summary([r[k] for r in rounds]) for k in (key, "stall_s", "step_s")}
        parts["steps_lost"] = summary([r[key] + r["stall_s"] / r["step_s"] for r in rounds])
        return parts

    import importlib.metadata

    emit({
        "torchft": importlib.metadata.version("torchft"),
        "config": {
            "replicas": 2, "processes_per_replica": 1, "model": "MLP 8-64-1, batch 8", "kill_at_step": args.kill_at,
            "lighthouse_heartbeat_timeout_ms": 3000,
            "step_sleep_s": args.loss_sleep, "elastic_save_every": args.save_every, "timed_steps": args.timed_steps,
        },
        "ft": lost(losses["ft"], "failed"),
        "elastic": lost(losses["elastic"], "redone"),
        "step_time": {"ddp_s": summary(times["ddp"]), "ft_s": summary(times["ft"]),
                      "ft_over_ddp": summary([f / d for f, d in zip(times["ft"], times["ddp"])])},
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
