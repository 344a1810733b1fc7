"""The Hugging Face stack (TRL, PEFT, the Trainer's resume, FSDP) under the real accelerate or under hasten's hook.

usage: python hf_stack.py (plain|install) OUT_DIR SCENARIO[,SCENARIO...] [ARG]
(install: hasten.install_as_accelerate() first; plain: whatever ``import accelerate`` finds, so under
``hasten launch --as_accelerate`` it is hasten too). Scenarios, each writing OUT_DIR/<scenario>.json
on the main process (per-step training losses, logging_steps=1, and which library answered):

  sft     TRL's SFTTrainer on a tiny Llama with a word-level tokenizer made here
  dpo     TRL's DPOTrainer on the same (the reference model: a second copy of the initial model)
  lora    PEFT LoRA adapters on a tiny GPT-2 through transformers' Trainer
  full    the Trainer, 8 steps without interruption, a checkpoint at step 4 (OUT_DIR/full/checkpoint-4)
  resume  the Trainer resumed to step 8 from ARG (a checkpoint-4 folder written by either library), else from
          OUT_DIR/full/checkpoint-4 (``full`` earlier in the same run)
  fsdp    ``full`` with TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2}) (run on 2 processes)
  fsdp_resume  ``resume`` with the same FSDP2 arguments (from OUT_DIR/fsdp/checkpoint-4 without ARG)
  tp      ``full`` with TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2)) (2 processes: one
          data-parallel rank, so its losses are one process's ``full``); hasten shards it with FSDP2 on the
          (dp_shard=1, tp=2) mesh and its default SHARDED_STATE_DICT: the checkpoint is DCP folders
  tp_resume  ``resume`` with the same arguments (from OUT_DIR/tp/checkpoint-4 without ARG)
  tp_full  ``tp`` with fsdp=True, fsdp_config={"version": 2} too: the Trainer's FULL_STATE_DICT, so the
          checkpoint holds the gathered weights (model.safetensors) and the whole optimizer state (optimizer.bin)
  tp_full_resume  ``resume`` with ``tp_full``'s arguments (from OUT_DIR/tp_full/checkpoint-4 without ARG)

``resume`` scenarios also report ``adam_steps``: the optimizer's step count at the end (8 when the
checkpoint's optimizer state was loaded, 4 when it started afresh).

Same seeds, random data, nothing from the hub: both libraries train the same numbers.
"""

import json
import os
import sys

mode, out, scenarios = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
extra = sys.argv[4] if len(sys.argv) > 4 else None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if mode == "install":
    import hasten

    hasten.install_as_accelerate()

import accelerate  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

WORDS = [f"w{i}" for i in range(40)]
COMMON = dict(  # noqa: C408 - the TrainingArguments every scenario shares
    use_cpu=True, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1,
    save_strategy="no",
)  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built from a vocabulary made here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = None
    return fast


def llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def sentences(n: int, seed: int, low: int = 4, high: int = 10) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g)) for k in lengths]


def losses(trainer, after: int = 0) -> list[float]:
    """The training loss of every step after ``after`` (a resumed Trainer's history holds the earlier ones too)."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def run_sft(folder: str) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    data = Dataset.from_dict({"text": sentences(32, seed=1)})
    args = SFTConfig(
        output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, max_length=16, packing=False, **COMMON,
    )  # fmt: skip
    trainer = SFTTrainer(model=llama(len(tok)), args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return {"losses": losses(trainer), "trainer": trainer}


def run_dpo(folder: str) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = tokenizer()
    data = Dataset.from_dict(
        {"prompt": sentences(24, 2, 2, 5), "chosen": sentences(24, 3, 2, 6), "rejected": sentences(24, 4, 2, 6)}
    )
    args = DPOConfig(
        output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=4,
        learning_rate=1e-2, max_length=16, **COMMON,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=llama(len(tok)), ref_model=llama(len(tok)), args=args, train_dataset=data, processing_class=tok
    )
    trainer.train()
    rewards = [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h]
    return {"losses": losses(trainer), "margins": rewards, "trainer": trainer}


class Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def rows(n: int = 64, vocab: int = 64) -> Rows:
    return Rows(torch.randint(0, vocab, (n, 16), generator=torch.Generator().manual_seed(1)))


def run_lora(folder: str) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-2, **COMMON,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows())
    trainer.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"losses": losses(trainer), "trainable": trainable, "trainer": trainer}


def resumable(folder: str, **kwargs) -> Trainer:
    common = {**COMMON, "save_strategy": "steps", "save_steps": 4, **kwargs}
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, **common,
    )  # fmt: skip
    return Trainer(model=llama(64), args=args, train_dataset=rows())


def run_full(folder: str, **kwargs) -> dict:
    trainer = resumable(folder, **kwargs)
    trainer.train()
    saved = sorted(os.listdir(os.path.join(folder, "checkpoint-4")))
    sharded = type(next(iter(trainer.model_wrapped.parameters()))).__name__  # DTensor under FSDP2
    return {"losses": losses(trainer), "saved": saved, "param_type": sharded, "trainer": trainer}


def run_resume(folder: str, done: str = "full", **kwargs) -> dict:
    """Resume from ARG, else from the checkpoint-4 that the scenario ``done`` wrote earlier in this run."""
    trainer = resumable(folder, **kwargs)
    trainer.train(resume_from_checkpoint=extra or os.path.join(out, done, "checkpoint-4"))
    adam = max(float(s["step"]) for s in trainer.optimizer.optimizer.state.values())
    return {"losses": losses(trainer, after=4), "steps": trainer.state.global_step, "adam_steps": adam,
            "trainer": trainer}  # fmt: skip


FSDP = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


def run_fsdp(folder: str) -> dict:
    return run_full(folder, **FSDP)


def run_fsdp_resume(folder: str) -> dict:
    return run_resume(folder, "fsdp", **FSDP)


def tp(**kwargs) -> dict:
    """The Trainer's arguments for tensor parallelism over the 2 processes (a ParallelismConfig each time)."""
    from accelerate.parallelism_config import ParallelismConfig

    return {"parallelism_config": ParallelismConfig(tp_size=2), **kwargs}


FULL = {"fsdp": True, "fsdp_config": {"version": 2}}  # the Trainer's own FSDP2 plugin: FULL_STATE_DICT


def run_tp(folder: str) -> dict:
    result = run_full(folder, **tp())
    result["state_dict_type"] = str(result["trainer"].accelerator.state.fsdp_plugin.state_dict_type)
    return result


def run_tp_resume(folder: str) -> dict:
    return run_resume(folder, "tp", **tp())


def run_tp_full(folder: str) -> dict:
    return run_full(folder, **tp(**FULL))


def run_tp_full_resume(folder: str) -> dict:
    return run_resume(folder, "tp_full", **tp(**FULL))


RUN = {"sft": run_sft, "dpo": run_dpo, "lora": run_lora, "full": run_full, "resume": run_resume}
RUN.update(fsdp=run_fsdp, fsdp_resume=run_fsdp_resume, tp=run_tp, tp_resume=run_tp_resume)
RUN.update(tp_full=run_tp_full, tp_full_resume=run_tp_full_resume)

for scenario in scenarios:
    result = RUN[scenario](os.path.join(out, scenario))
    trainer = result.pop("trainer")
    if trainer.accelerator.is_main_process:
        result["accelerate"] = type(trainer.accelerator).__module__
        result["version"] = accelerate.__version__
        result["world"] = trainer.accelerator.num_processes
        with open(os.path.join(out, f"{scenario}.json"), "w") as f:
            json.dump(result, f)
    trainer.accelerator.wait_for_everyone()
    del trainer
