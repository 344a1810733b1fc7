"""transformers' Trainer on a tiny Llama, under the real accelerate or under hasten.install_as_accelerate().

usage: python as_accelerate_trainer.py (plain|install) OUT_DIR  (install: hasten.install_as_accelerate() first)
Writes OUT_DIR/result.json on the main process: the per-step training losses (logging_steps=1),
the eval loss, the files of the saved checkpoint, and which library answered ``import accelerate``.
Same seed, random data, nothing from the hub: the two runs train the same numbers.
"""

import json
import os
import sys

mode, out = sys.argv[1], sys.argv[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if mode == "install":
    import hasten

    hasten.install_as_accelerate()

import accelerate  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
model = LlamaForCausalLM(config)
g = torch.Generator().manual_seed(1)
rows = torch.randint(0, 64, (48, 16), generator=g)


class Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


args = TrainingArguments(
    output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
    max_steps=6, learning_rate=1e-2, logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="steps",
    save_steps=6, bf16=True, use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
)  # fmt: skip
trainer = Trainer(model=model, args=args, train_dataset=Rows(rows[:32]), eval_dataset=Rows(rows[32:]))
trainer.train()
metrics = trainer.evaluate()
if trainer.accelerator.is_main_process:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    saved = sorted(os.listdir(os.path.join(out, "checkpoint-6")))
    result = {
        "accelerate": type(trainer.accelerator).__module__,
        "version": accelerate.__version__,
        "losses": losses,
        "evals": evals,
        "final_eval": metrics["eval_loss"],
        "saved": saved,
        "world": trainer.accelerator.num_processes,
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
