"""PEFT's PeftModel.from_pretrained on a base that transformers loaded with device_map="auto" and layers
on the CPU and on disk (hasten installed as accelerate with the argument "hasten", the real Accelerate
without): a LoRA adapter saved from a tiny Llama, loaded onto the dispatched base and onto a plain base;
prints the maps, whether logits and greedy generate are equal, and the device of an offloaded weight
after the forward (JSON on the last line). Run it in an empty folder: PEFT writes the rewritten
safetensors of disk-offloaded layers under the working directory."""

import json
import os
import sys
import tempfile

import torch

if sys.argv[1:] == ["hasten"]:
    from hasten.compat.as_accelerate import install_as_accelerate

    install_as_accelerate()
import accelerate  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
ids = torch.randint(0, 128, (1, 8))
with tempfile.TemporaryDirectory() as root:
    # PEFT renames the folder part holding "--" (the hub cache's "models--org--name") for the files it rewrites
    base_dir = os.path.join(root, "models--tiny--llama")
    adapter_dir = os.path.join(root, "adapter")
    LlamaForCausalLM(config).save_pretrained(base_dir, max_shard_size="60KB")
    trained = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    trained.save_pretrained(adapter_dir)

    plain = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    budget = {"cpu": 400_000}
    offload = os.path.join(root, "offload")
    base = LlamaForCausalLM.from_pretrained(base_dir, device_map="auto", max_memory=budget, offload_folder=offload)
    base_map = {k: str(v) for k, v in base.hf_device_map.items()}
    with torch.no_grad():
        base_logits = base(ids).logits
    model = PeftModel.from_pretrained(base, adapter_dir, max_memory=budget, offload_folder=offload).eval()
    with torch.no_grad():
        expected, found = plain(ids).logits, model(ids).logits
    same_generate = torch.equal(
        model.generate(input_ids=ids, max_new_tokens=5, do_sample=False),
        plain.generate(input_ids=ids, max_new_tokens=5, do_sample=False),
    )
    last = model.base_model.model.model.layers[-1].self_attn.q_proj
    print(
        json.dumps(
            {
                "accelerate": accelerate.__file__,
                "base_map": base_map,
                "map": {k: str(v) for k, v in model.hf_device_map.items()},
                "logits": torch.allclose(found, expected, atol=1e-5),
                "adapter_changes_logits": not torch.allclose(expected, base_logits, atol=1e-3),
                "generate": same_generate,
                "offloaded_after_forward": str(last.base_layer.weight.device),
            }
        )
    )
