"""Fine-tune a causal language model (transformers) on hasten: one process, DDP, FSDP2 or Ulysses.

    python examples/causal_lm.py                                          # one process
    hasten launch --num_processes 2 examples/causal_lm.py                 # DDP: each process its own rows
    hasten launch --num_processes 2 examples/causal_lm.py --fsdp          # FSDP2: each decoder layer sharded
    hasten launch --num_processes 2 examples/causal_lm.py --sp_size 2     # Ulysses: each sequence split in 2

The model is a small Llama built from a ``LlamaConfig``, or ``--model DIR``: a local folder written by
``save_pretrained`` (``--output_dir`` of an earlier run is one). The data is synthetic (sequences that
count up in steps of 1 to 3, which a model learns in a few dozen steps), or ``--data FILE``: a local
text file, tokenized by the model folder's tokenizer, else as bytes. Nothing is downloaded.

``--batch_size`` is the number of sequences per optimizer step over all processes, so every mode
trains on the same rows in the same order and prints the same losses (to rounding): the one-process
run is the reference the others can be checked against (tests/test_examples_causal_lm.py does).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, get_linear_schedule_with_warmup

from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

IGNORE = -100  # a label the loss skips


def shift_labels_of(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels of a causal LM, already shifted: position t is scored on token t + 1.

    transformers' models shift ``labels`` themselves (``labels[..., 1:]`` against ``logits[..., :-1]``),
    which is right only when the process holds whole sequences. Under sequence parallelism each
    process holds a slice of every sequence, so shifting there would drop the label at each slice's
    border (the first token of the next slice, held by another process). So the labels are shifted
    here, on the whole sequence, before anything is split, and given as ``shift_labels``: both
    ``input_ids`` and ``shift_labels`` are then cut into the same slices, and each slice scores its
    own positions against the right next tokens. The last position has no next token: IGNORE.

        input_ids     [t0, t1, t2, t3 | t4, t5, t6, t7]     (| : where 2 processes split it)
        shift_labels  [t1, t2, t3, t4 | t5, t6, t7, -100]   (t4 stays with process 0)
    """
    return torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=IGNORE)


class Sequences(Dataset):
    """Rows of ``seq_len`` tokens, each with its ``shift_labels`` (built on the whole row)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.labels = rows, shift_labels_of(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "shift_labels": self.labels[i]}


def synthetic_rows(count: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences that count up (modulo ``vocab``) from a random start in a random step of 1 to 3."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=g)
    step = torch.randint(1, 4, (count, 1), generator=g)
    return (start + step * torch.arange(seq_len)) % vocab


def text_rows(path: str, model_dir: str | None, seq_len: int, vocab: int) -> torch.Tensor:
    """The text of ``path`` as rows of ``seq_len`` tokens (the rest dropped): the model folder's
    tokenizer where it has one, else the UTF-8 bytes (which needs a vocabulary of 256 or more)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = None
    if model_dir is not None:
        with contextlib.suppress(OSError, ValueError):  # a folder without tokenizer files: bytes
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer is not None:
        ids = tokenizer(text)["input_ids"]
    elif vocab < 256:
        raise ValueError(f"--data {path!r}: read as bytes it needs a vocabulary of 256, the model has {vocab}")
    else:
        ids = list(text.encode("utf-8"))
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(f"--data {path!r} holds {len(ids)} tokens, fewer than one row of --seq_len {seq_len}")
    return torch.tensor(ids[: count * seq_len]).reshape(count, seq_len)


def build_model(model_dir: str | None, seq_len: int) -> torch.nn.Module:
    """A local folder's model, or a small Llama; with sdpa attention (what Ulysses wraps)."""
    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", local_files_only=True)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def make_accelerator(args: argparse.Namespace, model: torch.nn.Module) -> tuple[Accelerator, int]:
    """The Accelerator of the mode asked for, and the number of data-parallel processes (those that
    read different rows: every process but the ``sp_size`` of one sequence-parallel group share)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.sp_size < 1 or world % args.sp_size:
        raise ValueError(
            f"--sp_size {args.sp_size} must be a whole number >= 1 that divides the number of processes ({world})"
        )
    plugin, config = None, None
    if args.fsdp or args.sp_size > 1:  # Ulysses runs on FSDP2: the sp ranks' gradients add up in its reduce-scatter
        layers = list(getattr(model, "_no_split_modules", None) or [])  # ["LlamaDecoderLayer"]: one shard unit each
        plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=layers or None)
    if args.sp_size > 1:
        config = ParallelismConfig(sp_size=args.sp_size, sp_backend="torch", dp_shard_size=world // args.sp_size)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, fsdp_plugin=plugin, parallelism_config=config)
    return accelerator, world // args.sp_size


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local folder (save_pretrained's); else a small Llama")
    parser.add_argument("--data", default=None, help="a local text file; else synthetic sequences")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2: shard each decoder layer over the processes")
    parser.add_argument("--sp_size", type=int, default=1, help="Ulysses: split each sequence over this many processes")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per step, over all processes")
    parser.add_argument("--seq_len", type=int, default=64, help="tokens per sequence (a multiple of --sp_size)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5, help="steps of linear warm-up, then a linear decay to 0")
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--print_every", type=int, default=10)
    parser.add_argument("--output_dir", default=None, help="save the model (save_pretrained) here at the end")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; the losses printed (every process returns them)."""
    args = parse(argv)
    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = build_model(args.model, args.seq_len)
    accelerator, data_processes = make_accelerator(args, model)
    vocab = model.config.vocab_size
    if args.data is not None:
        rows = text_rows(args.data, args.model, args.seq_len, vocab)
    else:
        rows = synthetic_rows(args.batch_size * args.steps, args.seq_len, vocab, args.seed)
    if args.batch_size % data_processes:
        raise ValueError(
            f"--batch_size {args.batch_size} must divide over the {data_processes} data-parallel processes"
        )
    # each data-parallel process reads batch_size / data_processes rows; the processes of one sp group the same rows
    order = torch.Generator().manual_seed(args.seed)  # the same order of rows on any number of processes
    per_process = args.batch_size // data_processes
    loader = DataLoader(Sequences(rows), batch_size=per_process, shuffle=True, drop_last=True, generator=order)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # a prepared scheduler steps once per data-parallel process at each optimizer step: size it so
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup * data_processes, args.steps * data_processes)
    scheduler = accelerator.prepare(scheduler)

    losses: list[float] = []
    while len(losses) < args.steps:
        for batch in loader:
            ids, labels = batch["input_ids"], batch["shift_labels"]
            # --sp_size > 1: inside the block each process keeps its slice of both (in place); else it does nothing
            buffers = [ids, labels]
            split = accelerator.maybe_context_parallel(buffers, buffer_seq_dims=[1, 1], no_restore_buffers=set(buffers))
            with split:
                # transformers computes a loss only when `labels` is given, and then scores `shift_labels` as they are
                loss = model(input_ids=ids, labels=labels, shift_labels=labels).loss
                accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())  # the mean over every process's rows
            step = len(losses)
            if step % args.print_every == 0 or step in (1, args.steps):
                accelerator.print(f"step {step}: loss {losses[-1]:.6f} lr {scheduler.get_last_lr()[0]:.3e}")
            if step == args.steps:
                break

    mode = f"Ulysses sp {args.sp_size}" if args.sp_size > 1 else str(accelerator.distributed_type)
    accelerator.print(f"done: {args.steps} steps ({mode}, {accelerator.num_processes} process(es))")
    if args.output_dir:
        state = accelerator.get_state_dict(model)  # the whole model, gathered from the shards (on the main process)
        accelerator.unwrap_model(model).save_pretrained(
            args.output_dir, state_dict=state, is_main_process=accelerator.is_main_process
        )
        accelerator.wait_for_everyone()
    return losses


if __name__ == "__main__":  # (tests import the functions from here)
    main()
