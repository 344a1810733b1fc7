"""The main job: a small CNN learns handwritten digits, the way a hasten user trains.

scikit-learn's digits (1,797 8x8 images, shipped inside the package: nothing is
downloaded), a train/test split, DDP across the launched processes, bf16 autocast by
default (fp16 with a loss scaler works too, on CPU as well), gradient accumulation, a
checkpoint each epoch under the project dir, ``--resume`` from the latest one, a profiler
capture of a few steps, a progress bar on the main process, and a PNG of the curves.

    hasten launch --num_processes 2 examples/train_digits.py          # or: hasten demo
    hasten launch --num_processes 2 examples/train_digits.py --resume # continue a run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, GradScalerKwargs, ProfileKwargs
from hasten.utils import ThroughputMonitor, measure_flops, set_seed


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The script's options (``hasten demo`` reads them too, to check them before any process starts)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=add_help, allow_abbrev=False)
    p.add_argument("--epochs", type=int, default=10, help="epochs in all, counting those of a resumed run (default 10)")
    p.add_argument("--batch_size", type=int, default=32, help="per process and micro-step (default 32)")
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate of the one-cycle schedule (default 6e-3)")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="bf16", help="(default bf16)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2, help="(default 2)")
    p.add_argument(
        "--project_dir", default=None,
        help="run folder: checkpoints, profiler traces, TensorBoard logs, curves (default: hasten demo makes "
        "a new runs/digits/<mixed_precision>-<N>proc/run-<k> for each run, --resume continues the newest; "
        "launched without the demo, runs/digits/<mixed_precision>-<N>proc)",
    )  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in project_dir")
    p.add_argument("--max_steps_per_epoch", type=int, default=None, help="cut epochs short (smoke runs)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=42, help="(default 42)")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "gradient_accumulation_steps", "max_steps_per_epoch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")


def default_project_dir(mixed_precision: str, num_processes: int) -> str:
    return os.path.join("runs", "digits", f"{mixed_precision}-{num_processes}proc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.project_dir is None:
        args.project_dir = default_project_dir(args.mixed_precision, int(os.environ.get("WORLD_SIZE", "1")))
    return args


def resume_refusal(project_dir: str, mixed_precision: str, num_processes: int) -> str | None:
    """Why ``--resume`` cannot continue the run in ``project_dir`` with this configuration (None: it can).

    Reads the newest checkpoint's manifest (plain JSON), so the check costs nothing and runs
    before any process starts.
    """
    root = os.path.join(project_dir, "checkpoints")
    found = sorted(
        (int(m.group(1)), name)
        for name in (os.listdir(root) if os.path.isdir(root) else [])
        if (m := re.fullmatch(r"checkpoint_(\d+)", name))
        and os.path.isfile(os.path.join(root, name, "hasten_checkpoint.json"))
    )
    if not found:
        return f"--resume: there is no checkpoint in {root} yet; run once without --resume first"
    newest = os.path.join(root, found[-1][1])
    with open(os.path.join(newest, "hasten_checkpoint.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    saved_mp, saved_n = manifest.get("mixed_precision"), manifest.get("world_size")
    if saved_mp != mixed_precision:
        return (
            f"--resume: {newest} was saved with --mixed_precision {saved_mp}, this run asks for {mixed_precision}; "
            f"add --mixed_precision {saved_mp} to continue it (or leave out --project_dir: each precision has its own "
            "run folder)"
        )
    if saved_n != num_processes:
        return (
            f"--resume: {newest} was saved by {saved_n} process(es), this run has {num_processes}; "
            f"add --num_processes {saved_n} to continue it (or leave out --project_dir: each process count has its own "
            "run folder)"
        )
    return None


def one_cycle(total_steps: int, warmup_fraction: float = 0.3, start_div: float = 25.0, end_div: float = 1e4):  # noqa: ANN201
    """The one-cycle learning-rate factor (cosine up to 1, then cosine down), for LambdaLR.

    The factor depends on the step and on ``total_steps`` of *this* run only: a resumed run
    with another ``--epochs`` rebuilds the schedule for its own length (the checkpoint holds
    the step count, not the curve), and steps past the end keep the final value.
    """
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step <= warmup:
            low, high, t = 1 / start_div, 1.0, step / warmup
        else:
            low, high, t = 1.0, 1 / (start_div * end_div), min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return high + (low - high) * (1 + math.cos(math.pi * t)) / 2

    return factor


def load_digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(range(len(y)), test_size=0.2, random_state=seed, stratify=y.numpy())
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


class DigitsCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 128),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.25),
            torch.nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def count_flops(batch_size: int) -> int:
    """FLOPs of one micro-step (forward and backward) on one process, counted once on a meta copy
    of the model (nothing is allocated or computed)."""
    with torch.device("meta"):
        model = DigitsCNN()
        x = torch.empty(batch_size, 1, 8, 8)
        y = torch.zeros(batch_size, dtype=torch.long)
    return measure_flops(model, lambda: model(x), lambda out: F.cross_entropy(out, y))


def bar_text(metrics: dict) -> str:
    """The progress bar's figures: samples/s of all processes, FLOP/s (MFU where the device's peak
    is known) and this process's peak memory."""
    parts = []
    samples = metrics.get("samples_per_sec", metrics.get("device/samples_per_sec"))
    if samples is not None:
        parts.append(f"{samples:,.0f} samples/s")
    flops = metrics.get("flops_per_sec", metrics.get("device/flops_per_sec"))
    if flops:
        parts.append(f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:.2f} GFLOP/s")
    if "device/mfu" in metrics:
        parts.append(f"MFU {metrics['device/mfu']:.1%}")
    peak = metrics.get("device/peak_memory_gib")
    if peak is not None:
        parts.append(f"peak mem {peak * 1024:,.0f} MiB" if peak < 1 else f"peak mem {peak:.2f} GiB")
    return "  ".join(parts)


class History:
    """Per-epoch metrics, checkpointed with the run so a resumed run keeps its curves."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def state_dict(self) -> dict:
        return {"epochs": list(self.epochs)}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = list(state["epochs"])


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            preds, labels = accelerator.gather_for_metrics((model(x).argmax(dim=1), y))
            correct += int((preds == labels).sum())
            total += labels.numel()
    model.train()
    return correct / total


def plot_curves(history: History, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e["epoch"] + 1 for e in history.epochs]
    fig, ax_loss = plt.subplots(figsize=(7, 4), dpi=110)
    ax_loss.plot(epochs, [e["loss"] for e in history.epochs], "o-", color="tab:blue", label="train loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("train loss", color="tab:blue")
    ax_acc = ax_loss.twinx()
    ax_acc.plot(epochs, [e["test_accuracy"] for e in history.epochs], "s-", color="tab:green", label="test accuracy")
    ax_acc.set_ylabel("test accuracy", color="tab:green")
    ax_acc.set_ylim(0, 1.0)
    ax_loss.set_title("hasten demo: digits CNN")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        project_dir=args.project_dir,
        log_with="tensorboard" if tensorboard else None,
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**12)],
    )
    if args.resume:
        refusal = resume_refusal(args.project_dir, args.mixed_precision, accelerator.num_processes)
        if refusal:  # the same answer on every rank: say it once, stop everywhere
            if accelerator.is_main_process:
                print(f"train_digits.py: error: {refusal}", file=sys.stderr, flush=True)
            accelerator.end_training()
            raise SystemExit(2)
    set_seed(args.seed)
    train_set, test_set = load_digits_split(args.seed)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=128)
    # Optimizer steps per epoch on each process: its share of the batches (cut short by
    # --max_steps_per_epoch), one step per gradient_accumulation_steps of them.
    micro_steps_per_epoch = -(-len(train_loader) // accelerator.num_processes)
    if args.max_steps_per_epoch:
        micro_steps_per_epoch = min(micro_steps_per_epoch, args.max_steps_per_epoch)
    steps_per_epoch = -(-micro_steps_per_epoch // args.gradient_accumulation_steps)
    # A prepared scheduler steps num_processes times per optimizer step (Accelerate's rule), so
    # the schedule is sized in optimizer steps times num_processes, as the transformers examples do.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, one_cycle(args.epochs * steps_per_epoch * accelerator.num_processes)
    )
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )
    history = History()
    accelerator.register_for_checkpointing(history)
    # samples/s, FLOP/s and peak memory over the last 20 micro-steps: update() only appends numbers.
    monitor = ThroughputMonitor(accelerator, window_size=20, flops_per_batch=count_flops(args.batch_size))

    checkpoint = None
    if args.resume:
        checkpoint = accelerator.load_state()
        accelerator.print(f"resumed from {shown(checkpoint, args.project_dir)} ({len(history.epochs)} epoch(s) done)")
    start_epoch = len(history.epochs)
    if tensorboard:
        accelerator.init_trackers("tensorboard", config={k: v for k, v in vars(args).items() if v is not None})
    trace_dir = os.path.join(args.project_dir, "profile")
    # One full cycle: 1 step skipped, 1 waited, 2 of warm-up, 5 recorded (9 optimizer steps).
    profile_handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"skip_first": 1, "wait": 1, "warmup": 2, "active": 5, "repeat": 1},
        output_trace_dir=trace_dir,
        step_with_optimizer=True,
    )
    # A fresh run is profiled from its first step, across epochs until the cycle is done.
    profiling = accelerator.profile(profile_handler) if start_epoch == 0 else contextlib.nullcontext()
    use_bar = accelerator.is_main_process and not args.no_progress
    if use_bar:
        from tqdm.auto import tqdm

    step_count = start_epoch * steps_per_epoch  # optimizer steps so far, the x axis of TensorBoard
    with profiling:
        for epoch in range(start_epoch, args.epochs):
            started = time.perf_counter()
            monitor.reset()
            samples = 0
            total_loss = torch.zeros((), device=accelerator.device)
            micro_steps = 0
            bar = (
                tqdm(total=micro_steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False)
                if use_bar
                else None
            )
            for step, (x, y) in enumerate(train_loader):
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    step_count += 1
                    if tensorboard:
                        accelerator.log(
                            {"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0]}, step=step_count
                        )
                total_loss += loss.detach()
                micro_steps += 1
                samples += x.shape[0]
                monitor.update(time=time.perf_counter() - started, batches=micro_steps, samples=samples)
                if bar is not None:
                    if micro_steps % 5 == 0:  # shown now: a short epoch may end before tqdm's next refresh
                        bar.set_postfix_str(bar_text(monitor.compute()), refresh=True)
                    bar.update(1)
                if args.max_steps_per_epoch and step + 1 >= args.max_steps_per_epoch:
                    break
            if bar is not None:
                bar.close()
            elapsed = time.perf_counter() - started
            if micro_steps:
                monitor.compute_and_log(step=step_count)  # to every tracker (TensorBoard here), one call
            mean_loss = accelerator.reduce(total_loss / max(micro_steps, 1), "mean").item()
            throughput = accelerator.reduce(torch.tensor([samples / elapsed]), "sum").item()
            accuracy = evaluate(accelerator, model, test_loader)
            history.epochs.append(
                {"epoch": epoch, "loss": mean_loss, "test_accuracy": accuracy, "samples_per_s": throughput}
            )
            if tensorboard:
                accelerator.log(
                    {"epoch/loss": mean_loss, "epoch/test_accuracy": accuracy, "epoch/samples_per_s": throughput},
                    step=step_count,
                )
            accelerator.print(
                f"epoch {epoch + 1:>2}/{args.epochs}  loss {mean_loss:.4f}  test accuracy {accuracy:.4f}  "
                f"{throughput:,.0f} samples/s  lr {scheduler.get_last_lr()[0]:.2e}"
            )
            checkpoint = accelerator.save_state(total_limit=2)

    shown_trace = shown(trace_dir, args.project_dir)
    tensorboard_dir = os.path.join(args.project_dir, "tensorboard")
    result = {
        "test_accuracy": history.epochs[-1]["test_accuracy"] if history.epochs else None,
        "epochs": len(history.epochs),
        "checkpoint": shown(checkpoint, args.project_dir),
        "trace_dir": shown_trace if os.path.isdir(trace_dir) else None,
        "tensorboard_dir": shown(tensorboard_dir, args.project_dir) if tensorboard else None,
        "curves": None,
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
    }
    if accelerator.is_main_process and history.epochs:
        result["curves"] = os.path.join(args.project_dir, "curves.png")
        try:
            plot_curves(history, result["curves"])
        except ImportError:
            result["curves"] = None
            accelerator.print("matplotlib is not installed: pip install 'hasten[demo]' for the curves PNG")
        with open(os.path.join(args.project_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
        lines = [
            f"\nfinal test accuracy {result['test_accuracy']:.4f} on {accelerator.num_processes} process(es), "
            f"{accelerator.mixed_precision} mixed precision",
            f"  checkpoint: {result['checkpoint']}  (continue with --resume, more --epochs allowed)",
        ]
        if result["trace_dir"]:
            lines.append(f"  profiler traces: {result['trace_dir']}  (hasten profile-report {result['trace_dir']})")
        if result["tensorboard_dir"]:
            lines.append(
                "  TensorBoard: tensorboard --logdir "
                f"{os.path.dirname(result['tensorboard_dir'].rstrip(os.sep)) or '.'}"
            )
        else:
            lines.append("  TensorBoard: not installed (pip install tensorboard) so no logs were written")
        lines.append(f"  curves: {result['curves']}")
        accelerator.print("\n".join(lines))
    accelerator.end_training()
    return result


def shown(path: str | None, project_dir: str) -> str | None:
    """A path as the user would write it: relative when the run folder was given relative."""
    if path is None or os.path.isabs(project_dir):
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


if __name__ == "__main__":
    main()
