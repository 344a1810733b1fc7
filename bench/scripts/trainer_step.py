"""Row 19: transformers' Trainer on hasten (through ``install_as_accelerate()``) ÷ on Accelerate.

Two figures:

* the Trainer's step time: the same small Llama (built from a config, random tokens, nothing from
  the hub) trained by ``Trainer.train()`` in a fresh process per run, once with the real Accelerate
  answering ``import accelerate`` (A), once after ``hasten.install_as_accelerate()`` (H), and once
  more on Accelerate (A', the A/A control), the runs alternating round after round (A H A' / A' H A).
  A process cannot hold both libraries (the hook is process-wide), so each run is its own process;
  within it, a callback times every optimizer step (``on_step_end`` to ``on_step_end``: data,
  forward, backward, clipping, optimizer and scheduler, the Trainer's own book-keeping) and the run's
  figure is the median step after the warm-up steps. A round's ratio is H's figure over A's. Each step
  is timed by two clocks: the main thread's CPU time (one intra-op thread, so the whole step; what the
  headline uses, since on a shared machine the wall clock of a step swings with other processes'
  load) and the wall clock. With ``--procs 2`` the runs are 2-process ones under
  ``torch.distributed.run`` (DDP on gloo), each rank timing its own steps; rank 0's figures count.
* ``import transformers.trainer``: ``python -c`` with ``import hasten; hasten.install_as_accelerate()``
  first ÷ without (the child's CPU time, interleaved rounds, as row 2).

    python bench/scripts/trainer_step.py --rounds 6 --out result.json
    python bench/scripts/trainer_step.py --worker install OUT.json [model flags]   # one run (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import child_env, emit, interleave, ratio_summary, summary  # noqa: E402

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


# ---------------------------------------------------------------------- one run (a child process)
def worker(mode: str, out: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if mode == "install":
        import hasten

        hasten.install_as_accelerate()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 32), num_key_value_heads=max(1, args.width // 64),
        max_position_embeddings=args.seq,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    data = torch.randint(0, args.vocab, (args.batch * (args.steps + args.warmup) * 2, args.seq))

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": data[i], "labels": data[i]}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.cpu: list[float] = []
            self.wall: list[float] = []
            self.last: tuple[float, float] | None = None

        def on_step_end(self, *_: object, **__: object) -> None:
            now = (time.thread_time(), time.perf_counter())
            if self.last is not None:
                self.cpu.append(now[0] - self.last[0])
                self.wall.append(now[1] - self.last[1])
            self.last = now

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=args.steps + args.warmup,
            learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10**6, save_strategy="no", report_to=[],
            use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[clock])
        trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    keep = slice(args.warmup - 1, None)  # the first interval ends at step warmup + 1
    result = {
        "library": type(trainer.accelerator).__module__,
        "world": trainer.accelerator.num_processes,
        "cpu_step_s": statistics.median(clock.cpu[keep]),
        "wall_step_s": statistics.median(clock.wall[keep]),
        "steps": len(clock.cpu[keep]),
        "loss": trainer.state.log_history[-1].get("train_loss"),
    }
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fp:
            json.dump(result, fp)


# ---------------------------------------------------------------------- the driver
MODEL_FLAGS = ("width", "layers", "vocab", "seq", "batch", "steps", "warmup")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(mode: str, procs: int, args: argparse.Namespace, tmp: str) -> dict:
    out = os.path.join(tmp, f"{mode}-{time.monotonic_ns()}.json")
    flags = [x for name in MODEL_FLAGS for x in (f"--{name}", str(getattr(args, name)))]
    script = [HERE, "--worker", mode, out, *flags]
    if procs == 1:
        cmd = [sys.executable, *script]
    else:
        dist = ["-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr", "127.0.0.1"]
        cmd = [sys.executable, *dist, "--master_port", str(_free_port()), *script]
    env = {**child_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{mode} run ({procs} process(es)) failed:\n" + (proc.stdout + proc.stderr)[-3000:])
    with open(out, encoding="utf-8") as fp:
        result = json.load(fp)
    want = "hasten.accelerator" if mode == "install" else "accelerate.accelerator"
    if result["library"] != want or result["world"] != procs:
        raise RuntimeError(f"{mode} run: the Trainer's accelerator was {result['library']} on {result['world']}")
    return result


def step_ratios(procs: int, args: argparse.Namespace) -> dict:
    """Rounds of A, H, A' (order reversed every other round); per-round ratios over A."""
    order = ["plain", "install", "plain_again"]
    runs: dict[str, list[dict]] = {name: [] for name in order}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                runs[name].append(run_once("install" if name == "install" else "plain", procs, args, tmp))
    out: dict = {"rounds": args.rounds}
    for clock in ("cpu", "wall"):
        times = {name: [x[f"{clock}_step_s"] for x in runs[name]] for name in order}
        out[clock] = {
            "hasten": ratio_summary(times, "plain", "install"),
            "aa": ratio_summary(times, "plain", "plain_again"),
            "accelerate_step_ms": 1e3 * statistics.median(times["plain"]),
            "hasten_step_ms": 1e3 * statistics.median(times["install"]),
        }
    out["losses_equal"] = len({x["loss"] for name in order for x in runs[name]}) == 1
    out["steps_per_run"] = runs["plain"][0]["steps"]
    return out


def import_ratio(rounds: int) -> dict:
    """CPU time of ``import transformers.trainer`` with the installer ÷ without, each in its own process."""
    codes = {
        "without": "import transformers.trainer",
        "with": "import hasten; hasten.install_as_accelerate(); import transformers.trainer",
    }
    env = {**child_env(), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cpu: dict[str, list[float]] = {name: [] for name in codes}

    def runner(name: str):
        def run() -> None:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-c", codes[name]], check=True, env=env, capture_output=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)

        return run

    wall = interleave({name: runner(name) for name in codes}, rounds)
    cpu = {name: c[-rounds:] for name, c in cpu.items()}  # the warm-up run is not counted
    result = ratio_summary(cpu, "without", "with")
    result["wall"] = ratio_summary(wall, "without", "with")
    result["without_cpu_s"] = summary(cpu["without"])["median"]
    result["with_cpu_s"] = summary(cpu["with"])["median"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of A, H, A' runs")
    parser.add_argument("--procs", default="1", help="comma-separated process counts, e.g. 1,2")
    parser.add_argument("--import-rounds", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--no-others", action="store_true", help="ignored: the row is a comparison with Accelerate")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args)
        return
    import importlib.metadata

    try:
        versions = {lib: importlib.metadata.version(lib) for lib in ("transformers", "accelerate")}
    except importlib.metadata.PackageNotFoundError as exc:
        raise SystemExit(f"row 19 needs transformers and the real accelerate (the test extra): {exc}") from None
    result: dict = {"row": "trainer_step", "versions": versions, "model": {k: getattr(args, k) for k in MODEL_FLAGS}}
    result["procs"] = {p: step_ratios(int(p), args) for p in args.procs.split(",") if p}
    result["import"] = import_ratio(args.import_rounds)
    result["loadavg"] = list(os.getloadavg())
    emit(result, args.out)


if __name__ == "__main__":
    main()
