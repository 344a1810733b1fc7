"""A training script written for Hugging Face Accelerate, in the style of its examples.

tests/test_parity.py runs it with its `from accelerate` imports changed to `from hasten`
(and, where Accelerate is installed, as it is) and compares the two runs.

usage: accelerate_style_train.py OUT_DIR
"""

import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset


def main(out_dir: str) -> None:
    set_seed(0)
    project = ProjectConfiguration(project_dir=out_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        log_with="tensorboard",
        project_config=project,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
    )
    accelerator.init_trackers("run", config={"lr": 0.1, "epochs": 3})
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    for _epoch in range(3):
        model.train()
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
                step += 1
        accelerator.save_state()
    model.eval()
    with torch.no_grad():
        predictions = accelerator.gather_for_metrics(model(data.tensors[0].to(accelerator.device)))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        accelerator.save(
            {"weights": unwrapped.state_dict(), "predictions": predictions.cpu()}, os.path.join(out_dir, "final.pt")
        )
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
