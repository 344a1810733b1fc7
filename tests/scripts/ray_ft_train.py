"""hasten's fault tolerance under Ray Train's ``TorchftConfig`` (tests/test_ray_torchft.py).

argv: OUT MODE. A ``TorchTrainer`` with 2 CPU workers and ``TorchftConfig(lighthouse_kwargs=
{"min_replicas": M}, backend="gloo")``: Ray starts torchft's lighthouse and makes each worker a
replica group of its own. Each worker trains Linear(8, 4) with SGD on a fixed dataset (the data
and the loop of tests/scripts/ft_train.py) through hasten's ``Accelerator``:

* MODE "ddp": ``FaultToleranceKwargs(min_replicas=2, init_sync=False)`` given (both workers build
  the same weights; Ray's lighthouse with min_replicas=2 too: no step without both), 16 committed steps;
* MODE "fault": no handler (hasten turns fault tolerance on by itself under TorchftConfig); worker
  1 raises at its committed step 5, once (OUT/failed marks it); Ray replaces that replica group, the
  new worker heals from worker 0 and, after its first step, writes OUT/target (its step + 8); both
  train until the committed step reaches it (worker 0 goes on alone meanwhile).

Each worker writes OUT/worker{RANK}_{ATTEMPT}.json (ATTEMPT "a", or "b" for the replacement): the
committed step after each step, the weights at each committed step and at the end, the samples it
read, its replica group as hasten resolved it. The driver prints "RAY FT DONE" when ``fit`` returns.
"""

from __future__ import annotations

import json
import os
import sys
import time


def train_loop(config: dict) -> None:
    import ray.train
    import torch

    from hasten import Accelerator, FaultToleranceKwargs

    out, mode = config["out"], config["mode"]
    rank = ray.train.get_context().get_world_rank()
    attempt = "b" if os.path.exists(os.path.join(out, "failed")) and rank == 1 else "a"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(64)), batch_size=4)
    handlers = [FaultToleranceKwargs(min_replicas=2, init_sync=False)] if mode == "ddp" else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    handler = accelerator._fault_tolerance.handler  # the resolved one: Ray's replica group

    def weights() -> list[float]:
        inner = accelerator.unwrap_model(model)
        return torch.cat([inner.weight.detach().flatten(), inner.bias.detach().flatten()]).tolist()

    def target() -> float:
        if mode == "ddp":
            return 16
        try:
            with open(os.path.join(out, "target")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return float("inf")

    steps, by_step, seen = [], {}, []
    while accelerator.step < target():
        for xb, yb, ib in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(accelerator.step)
            by_step[accelerator.step] = weights()
            seen.extend(ib.tolist())
            if mode == "fault" and rank == 1 and attempt == "a" and accelerator.step >= 5:
                open(os.path.join(out, "failed"), "w").close()
                raise RuntimeError(f"simulated failure of replica group 1 at step {accelerator.step}")
            if attempt == "b" and len(steps) == 1:
                with open(os.path.join(out, "target.tmp"), "w") as f:
                    f.write(str(accelerator.step + 8))
                os.replace(os.path.join(out, "target.tmp"), os.path.join(out, "target"))
            if mode == "fault":
                time.sleep(0.1)  # worker 0 alone must not run far ahead while Ray replaces worker 1
            if accelerator.step >= target():
                break
    result = {
        "steps": steps, "by_step": by_step, "final": weights(), "seen": seen,
        "group": [handler.replica_group, handler.num_replica_groups, handler.lighthouse],
    }  # fmt: skip
    with open(os.path.join(out, f"worker{rank}_{attempt}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


def main() -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    out, mode = os.path.abspath(sys.argv[1]), sys.argv[2]
    ray.init(num_cpus=4, include_dashboard=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"out": out, "mode": mode},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 2 if mode == "ddp" else 1}, backend="gloo"),
        run_config=RunConfig(
            storage_path=os.path.join(out, "store"), name=mode, failure_config=FailureConfig(max_failures=1)
        ),
    )
    trainer.fit()
    print("RAY FT DONE", flush=True)


if __name__ == "__main__":
    main()
