"""transformers' from_pretrained(device_map="auto", offload_folder=...) on hasten's big-model loading
(installed as accelerate): a small Llama saved in shards, loaded with layers on the CPU and on disk;
prints the device map, whether logits and greedy generate equal the plain model's, and the device of
an offloaded layer's weight after the forward (JSON on the last line)."""

import json
import os
import sys
import tempfile

import torch

if sys.argv[1:] == ["hasten"]:
    from hasten.compat.as_accelerate import install_as_accelerate

    install_as_accelerate()
import accelerate  # noqa: E402
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
base = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (1, 8))
with tempfile.TemporaryDirectory() as folder:
    base.save_pretrained(folder, max_shard_size="60KB")
    model = LlamaForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": 400_000}, offload_folder=os.path.join(folder, "offload")
    ).eval()
    same_logits = torch.allclose(model(ids).logits, base(ids).logits, atol=1e-5)
    same_generate = torch.equal(
        model.generate(ids, max_new_tokens=5, do_sample=False), base.generate(ids, max_new_tokens=5, do_sample=False)
    )
    print(
        json.dumps(
            {
                "accelerate": accelerate.__file__,
                "map": {k: str(v) for k, v in model.hf_device_map.items()},
                "logits": same_logits,
                "generate": same_generate,
                "offloaded_after_forward": str(model.lm_head.weight.device),
            }
        )
    )
