"""load_checkpoint_and_dispatch, cpu_offload and disk_offload on a transformers model (a tiny Llama;
hasten installed as accelerate with the argument "hasten", the real Accelerate without): for each,
whether logits and greedy generate equal the plain model's, where an offloaded weight is after the
forward, and load_checkpoint_and_dispatch's device map (JSON on the last line)."""

import json
import os
import sys
import tempfile

import torch

if sys.argv[1:] == ["hasten"]:
    from hasten.compat.as_accelerate import install_as_accelerate

    install_as_accelerate()
import accelerate  # noqa: E402
from accelerate import cpu_offload, disk_offload, init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402
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
plain = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 128, (1, 8))
with torch.no_grad():
    expected = plain(ids).logits
    expected_ids = plain.generate(ids, max_new_tokens=5, do_sample=False)


def check(model: torch.nn.Module, weight: torch.nn.Parameter) -> dict:
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    return {
        "logits": torch.allclose(logits, expected, atol=1e-5),
        "generate": torch.equal(generated, expected_ids),
        "offloaded_after_forward": str(weight.device),
    }


found = {"accelerate": accelerate.__file__}
with tempfile.TemporaryDirectory() as folder:
    plain.save_pretrained(folder, max_shard_size="60KB")  # several shards and their index
    with init_empty_weights():
        empty = LlamaForCausalLM(config)
    dispatched = load_checkpoint_and_dispatch(
        empty.eval(),
        folder,
        device_map="auto",
        max_memory={"cpu": 500_000},
        no_split_module_classes=["LlamaDecoderLayer"],
        offload_folder=os.path.join(folder, "offload"),
    )
    found["map"] = {k: str(v) for k, v in dispatched.hf_device_map.items()}
    found["load_checkpoint_and_dispatch"] = check(dispatched, dispatched.lm_head.weight)

    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(plain.state_dict())
    model = cpu_offload(model, execution_device="cpu")
    found["cpu_offload"] = check(model, model.model.layers[1].mlp.up_proj.weight)

    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(plain.state_dict())
    model = disk_offload(model, os.path.join(folder, "disk"), execution_device="cpu")
    found["disk_offload"] = check(model, model.model.layers[1].mlp.up_proj.weight)
print(json.dumps(found))
