"""A script that imports transformers' models first (transformers then imports torchao, which
hasten's test and fp8 extras install), then runs a tiny causal LM step through hasten: what a
plain run prints must be the script's own lines (tests/test_docs.py::test_console_is_quiet...)."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hasten import Accelerator

config = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(AutoModelForCausalLM.from_config(config))
ids = torch.randint(0, 64, (2, 8))
loss = model(input_ids=ids, labels=ids).loss
accelerator.backward(loss)
print(f"rank {accelerator.process_index} loss ok {bool(torch.isfinite(loss))}", flush=True)
accelerator.end_training()
