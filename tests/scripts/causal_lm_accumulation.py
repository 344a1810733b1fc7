"""A tiny LlamaForCausalLM trained with gradient accumulation as Accelerate's
``by_feature/gradient_accumulation_for_autoregressive_models.py`` does it: the loss of each
micro-batch, which still requires grad, goes to ``gather_for_metrics(loss.repeat(n))`` before
its backward (on 2 gloo processes that call raised "A view was created in no_grad mode ...").

usage: causal_lm_accumulation.py OUT

The global batches are the same at any number of processes (8 sequences of 16 tokens per
micro-batch over all processes, all of one length, so a mean over each process's tokens
averages to the global mean); each process writes OUT/rank{r}.json with its gathered losses
and, from the main process, the final weights' sums.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from hasten import Accelerator

out = sys.argv[1]
GLOBAL_BATCH, SEQ, MICRO_BATCHES = 8, 16, 4
accelerator = Accelerator(gradient_accumulation_steps=2)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=64, max_position_embeddings=SEQ)  # fmt: skip
model = LlamaForCausalLM(config)
tokens = torch.randint(
    0, config.vocab_size, (GLOBAL_BATCH * MICRO_BATCHES, SEQ), generator=torch.Generator().manual_seed(1)
)
loader = DataLoader(TensorDataset(tokens), batch_size=GLOBAL_BATCH // accelerator.num_processes)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
gathered = []
for (ids,) in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=ids, labels=ids).loss
        gathered.append(accelerator.gather_for_metrics(loss.repeat(ids.shape[0])))  # still requires grad here
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
weights = accelerator.get_state_dict(model)
record = {
    "losses": [g.tolist() for g in gathered],
    "requires_grad": [g.requires_grad for g in gathered],
    "sums": {k: float(v.double().sum()) for k, v in weights.items()} if accelerator.is_main_process else None,
}
with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump(record, f)
accelerator.end_training()
