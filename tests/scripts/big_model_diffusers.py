"""diffusers' enable_model_cpu_offload and enable_sequential_cpu_offload with device="cpu" (they need
no CUDA when given a device) on a tiny DiT pipeline (transformer -> vae), hasten installed as
accelerate with the argument "hasten", the real Accelerate without: whether the images equal the
plain pipeline's, the hooks' classes (checked by diffusers against accelerate.hooks) and where the
weights are after the call (JSON on the last line)."""

import json
import sys

import torch

if sys.argv[1:] == ["hasten"]:
    from hasten.compat.as_accelerate import install_as_accelerate

    install_as_accelerate()
import accelerate  # noqa: E402
import accelerate.hooks  # noqa: E402
from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel  # noqa: E402


def pipeline() -> DiTPipeline:
    torch.manual_seed(0)
    transformer = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,  # learned sigma, as DiT's checkpoints: the pipeline keeps the first half
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=1000,  # the pipeline asks for class 1000 (no class) for guidance
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=8,
    )
    return DiTPipeline(transformer=transformer.eval(), vae=vae.eval(), scheduler=DDIMScheduler())


def images(pipe: DiTPipeline) -> torch.Tensor:
    out = pipe(
        class_labels=[1, 3],
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=3,
        output_type="np",
    )
    return torch.from_numpy(out.images)


def model_offload() -> dict:
    pipe = pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    return {
        "images": torch.allclose(images(pipe), expected, atol=1e-5),
        "hook": isinstance(pipe.transformer._hf_hook, accelerate.hooks.CpuOffload),
        "hooks": len(pipe._all_hooks),
        "execution_device": str(pipe._execution_device),
        "again": torch.allclose(images(pipe), expected, atol=1e-5),  # maybe_free_model_hooks put the hooks back
    }


def sequential_offload() -> dict:
    pipe = pipeline()
    pipe.enable_sequential_cpu_offload(device="cpu")
    return {
        "images": torch.allclose(images(pipe), expected, atol=1e-5),
        "hook": isinstance(pipe.transformer.proj_out_2._hf_hook, accelerate.hooks.AlignDevicesHook),
        "execution_device": str(pipe._execution_device),
        "weights_after": sorted({str(p.device) for p in pipe.transformer.parameters()}),
        "again": torch.allclose(images(pipe), expected, atol=1e-5),
    }


expected = images(pipeline())
found = {"accelerate": accelerate.__file__}
for name, scenario in (("model", model_offload), ("sequential", sequential_offload)):
    try:
        found[name] = scenario()
    except Exception as e:  # reported, so that the other scenario still runs
        found[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
print(json.dumps(found))
