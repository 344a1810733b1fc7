"""diffusers' unconditional image training loop, cut down: under the real accelerate or under hasten's hook.

usage: python hf_diffusers.py (plain|install) OUT_DIR [CHECKPOINT]
The shape of diffusers' examples/unconditional_image_generation/train_unconditional.py: a UNet2DModel
(a tiny config), DDPMScheduler noise, EMAModel, save/load pre-hooks that take the model out of
``save_state``/``load_state`` and write ``unet/`` and ``unet_ema/`` themselves, TensorBoard logging
of ``ema_decay`` (None without EMA, as the script logs it), ``save_state`` at step 4 of 8. With
CHECKPOINT (a ``checkpoint-4`` folder, written by either library) the run resumes from it the way the
script does (load_state, then skip the steps already done). Writes OUT_DIR/result.json: per-step
losses, the EMA decay and optimisation step, the checkpoint's files and which library ran.
"""

import json
import os
import sys

mode, out = sys.argv[1], sys.argv[2]
resume = sys.argv[3] if len(sys.argv) > 3 else None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if mode == "install":
    import hasten

    hasten.install_as_accelerate()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from diffusers import DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

STEPS, SAVE_AT, BATCH = 8, 4, 4
accelerator = Accelerator(
    gradient_accumulation_steps=1, mixed_precision="no", log_with="tensorboard", cpu=True,
    project_config=ProjectConfiguration(project_dir=out, logging_dir=os.path.join(out, "logs")),
)  # fmt: skip
torch.manual_seed(0)
model = UNet2DModel(
    sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
    down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
)  # fmt: skip
ema_model = EMAModel(
    model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75,
    model_cls=UNet2DModel, model_config=model.config,
)  # fmt: skip


def save_model_hook(models, weights, output_dir):
    if accelerator.is_main_process:
        ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
        for model in models:
            model.save_pretrained(os.path.join(output_dir, "unet"))
            weights.pop()  # the weights are written above: save_state writes no model file


def load_model_hook(models, input_dir):
    loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
    ema_model.load_state_dict(loaded.state_dict())
    ema_model.to(accelerator.device)
    for _ in range(len(models)):
        model = models.pop()  # load_state then reads no model file
        loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
        model.register_to_config(**loaded.config)
        model.load_state_dict(loaded.state_dict())


accelerator.register_save_state_pre_hook(save_model_hook)
accelerator.register_load_state_pre_hook(load_model_hook)

noise_scheduler = DDPMScheduler(num_train_timesteps=100, beta_schedule="linear")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-6)
images = torch.rand(16, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
data = [{"input": image} for image in images]
loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=STEPS)
model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
ema_model.to(accelerator.device)
accelerator.init_trackers("train_unconditional")

global_step, first_epoch, resume_step = 0, 0, 0
if resume:
    accelerator.load_state(resume)
    global_step = int(os.path.basename(resume).split("-")[1])
    first_epoch, resume_step = divmod(global_step, len(loader))

losses, decays = {}, {}
for epoch in range(first_epoch, STEPS // len(loader)):
    model.train()
    for step, batch in enumerate(loader):
        if resume and epoch == first_epoch and step < resume_step:
            continue  # the script's way of skipping what the checkpoint already trained
        clean = batch["input"]
        noise = torch.randn(clean.shape, dtype=clean.dtype, device=clean.device)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.shape[0],), device=clean.device)
        noisy = noise_scheduler.add_noise(clean, noise, timesteps)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(noisy, timesteps).sample.float(), noise)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema_model.step(model.parameters())
            global_step += 1
            if global_step % SAVE_AT == 0 and accelerator.is_main_process:
                accelerator.save_state(os.path.join(out, f"checkpoint-{global_step}"))
        logs = {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0], "step": global_step}
        logs["ema_decay"] = ema_model.cur_decay_value
        logs["no_ema_decay"] = None  # what the script logs without --use_ema: a tracker skips it
        accelerator.log(logs, step=global_step)
        losses[global_step], decays[global_step] = logs["loss"], logs["ema_decay"]
accelerator.wait_for_everyone()
accelerator.end_training()

if accelerator.is_main_process:
    shadow = torch.cat([p.flatten() for p in ema_model.shadow_params])
    result = {
        "accelerate": type(accelerator).__module__,
        "losses": losses,
        "decays": decays,
        "ema_step": ema_model.optimization_step,
        "ema_sum": shadow.double().sum().item(),
        "saved": sorted(os.listdir(os.path.join(out, f"checkpoint-{SAVE_AT}"))) if not resume else None,
        "logs": sorted(os.listdir(os.path.join(out, "logs"))),
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
