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
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, GradScalerKwargs, ProfileKwargs
from hasten.utils import set_seed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=32, help="per process and micro-step")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="bf16")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--project_dir", default="runs/digits")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in project_dir")
    p.add_argument("--max_steps_per_epoch", type=int, default=None, help="cut epochs short (smoke runs)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


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
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        project_dir=args.project_dir,
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**12)],
    )
    set_seed(args.seed)
    train_set, test_set = load_digits_split(args.seed)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=128)
    micro_steps_per_epoch = -(-len(train_loader) // accelerator.num_processes)
    if args.max_steps_per_epoch:
        micro_steps_per_epoch = min(micro_steps_per_epoch, args.max_steps_per_epoch)
    steps_per_epoch = -(-micro_steps_per_epoch // args.gradient_accumulation_steps)
    # A prepared scheduler steps num_processes times per optimizer step (Accelerate's rule), so
    # the schedule is sized in optimizer steps times num_processes, as the transformers examples do.
    total_steps = args.epochs * steps_per_epoch * accelerator.num_processes + 1
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )
    history = History()
    accelerator.register_for_checkpointing(history)

    checkpoint = None
    if args.resume:
        checkpoint = accelerator.load_state()
        accelerator.print(f"resumed from {checkpoint} ({len(history.epochs)} epoch(s) done)")
    start_epoch = len(history.epochs)
    trace_dir = os.path.join(args.project_dir, "profile")
    profile_handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"skip_first": 2, "wait": 1, "warmup": 1, "active": 3, "repeat": 1},
        output_trace_dir=trace_dir,
        step_with_optimizer=True,
    )
    use_bar = accelerator.is_main_process and not args.no_progress
    if use_bar:
        from tqdm.auto import tqdm

    for epoch in range(start_epoch, args.epochs):
        started = time.perf_counter()
        samples = 0
        total_loss = torch.zeros((), device=accelerator.device)
        micro_steps = 0
        bar = tqdm(total=len(train_loader), desc=f"epoch {epoch + 1}/{args.epochs}", leave=False) if use_bar else None
        # The first epoch of a fresh run is profiled: a few optimizer steps, then the profiler idles.
        profiling = accelerator.profile(profile_handler) if epoch == 0 else None
        with profiling if profiling is not None else contextlib.nullcontext():
            for step, (x, y) in enumerate(train_loader):
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                total_loss += loss.detach()
                micro_steps += 1
                samples += x.shape[0]
                if bar is not None:
                    bar.update(1)
                if args.max_steps_per_epoch and step + 1 >= args.max_steps_per_epoch:
                    break
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - started
        mean_loss = accelerator.reduce(total_loss / max(micro_steps, 1), "mean").item()
        throughput = accelerator.reduce(torch.tensor([samples / elapsed]), "sum").item()
        accuracy = evaluate(accelerator, model, test_loader)
        history.epochs.append({"epoch": epoch, "loss": mean_loss, "test_accuracy": accuracy, "samples_per_s": throughput})
        accelerator.print(
            f"epoch {epoch + 1:>2}/{args.epochs}  loss {mean_loss:.4f}  test accuracy {accuracy:.4f}  "
            f"{throughput:,.0f} samples/s  lr {scheduler.get_last_lr()[0]:.2e}"
        )
        checkpoint = accelerator.save_state(total_limit=2)

    result = {
        "test_accuracy": history.epochs[-1]["test_accuracy"] if history.epochs else None,
        "epochs": len(history.epochs),
        "checkpoint": checkpoint,
        "trace_dir": trace_dir if os.path.isdir(trace_dir) else None,
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
        accelerator.print(
            f"\nfinal test accuracy {result['test_accuracy']:.4f} on {accelerator.num_processes} process(es), "
            f"{accelerator.mixed_precision} mixed precision\n"
            f"  checkpoint: {result['checkpoint']}\n"
            f"  profiler traces: {result['trace_dir']}  (hasten profile-report {result['trace_dir']})\n"
            f"  curves: {result['curves']}"
        )
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
