"""hasten inside Ray Train: a ``TorchTrainer`` runs the loop on N workers, Ray makes the process
group and hasten's ``Accelerator`` adopts it (nothing to launch with ``hasten launch``).

Run it (``pip install 'hasten[ray]'``; Ray starts a local cluster when none is running)::

    python examples/ray_train.py --workers 2 --epochs 2 --storage /tmp/ray-results
    python examples/ray_train.py --workers 2 --epochs 4 --storage /tmp/ray-results --fsdp   # sharded

Checkpoints follow Ray's own pattern: each worker saves into a temporary folder of its own
(``tempfile.TemporaryDirectory()``) and reports it with ``ray.train.report``; Ray gathers the
workers' files into one checkpoint under ``--storage``. With FSDP every worker writes its own
shards there; hasten writes each rank's part into the folder that rank was given and the
manifest into the main process's. A run started again with the same ``--storage`` and ``--name``
resumes from Ray's latest checkpoint (``ray.train.get_checkpoint()``), at any number of workers.
``--shared DIR`` saves into one folder all workers see instead (a shared disk or an object-store
URL) and reports that.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def dataset(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(dim=1, keepdim=True) > 0).float())


def train_loop(config: dict) -> None:
    import ray.train

    from hasten import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT") if config["fsdp"] else None
    accelerator = Accelerator(fsdp_plugin=plugin)  # adopts the process group Ray made
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # Ray's latest: the workers' files gathered in one folder
        with checkpoint.as_directory() as folder:
            accelerator.load_state(folder)
            start = int(open(os.path.join(folder, "epoch.txt")).read()) + 1

    for epoch in range(start, config["epochs"]):
        total = torch.zeros(())
        for x, y in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        metrics = {"epoch": epoch, "loss": float(accelerator.reduce(total / len(loader), "mean"))}
        if config["shared"]:
            folder = os.path.join(config["shared"], f"epoch_{epoch}")
            accelerator.save_state(folder)
            _mark(accelerator, folder, epoch)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
            continue
        with tempfile.TemporaryDirectory() as folder:  # Ray's pattern: a folder per worker
            accelerator.save_state(folder)
            _mark(accelerator, folder, epoch)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    accelerator.end_training()


def _mark(accelerator, folder: str, epoch: int) -> None:
    if accelerator.is_main_process:
        with open(os.path.join(folder, "epoch.txt"), "w") as f:
            f.write(str(epoch))


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage", default=os.path.abspath("ray-results"), help="Ray's storage_path")
    parser.add_argument("--name", default="hasten-ray")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2")
    parser.add_argument("--shared", default=None, help="save into this folder every worker sees")
    args = parser.parse_args()
    if not ray.is_initialized():
        ray.init(num_cpus=max(args.workers, 1), include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "fsdp": args.fsdp, "shared": args.shared},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage, name=args.name),
    )
    result = trainer.fit()
    metrics = result.metrics
    print(f"final loss {metrics['loss']:.4f} after epoch {metrics['epoch']}; checkpoint {result.checkpoint.path}")


if __name__ == "__main__":
    main()
