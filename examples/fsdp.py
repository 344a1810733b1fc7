"""Sharded training (FSDP2): a small transformer, each block sharded on its own.

Run it on two processes (`hasten launch --num_processes 2 examples/fsdp.py`) or alone
(`python examples/fsdp.py`: one process, nothing to shard over, same code). With
`--checkpoint DIR` it saves a sharded checkpoint at the end, which
`hasten merge-weights DIR OUT` turns into one `OUT/model.safetensors`.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, FullyShardedDataParallelPlugin


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Reads a sequence of tokens and predicts its first token (a copy task)."""

    def __init__(self, vocab: int = 16, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint", default=None, help="save_state() here at the end")
    args = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["TransformerBlock"],  # fully_shard each block, then the root
        state_dict_type="SHARDED_STATE_DICT",  # save_state: each process writes its shards (DCP)
    )
    accelerator = Accelerator(mixed_precision=args.mixed_precision, fsdp_plugin=plugin)

    torch.manual_seed(0)  # the same initial weights and data on every process
    tokens = torch.randint(0, 16, (2048, 8))
    loader = DataLoader(TensorDataset(tokens, tokens[:, 0]), batch_size=32, shuffle=True)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built before prepare, as with Accelerate
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < args.steps:
        for inputs, targets in loader:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm over every shard
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0 or step == args.steps:
                mean_loss = accelerator.reduce(loss.detach(), "mean").item()
                accelerator.print(
                    f"step {step}: loss {mean_loss:.4f} ({accelerator.distributed_type}, "
                    f"{accelerator.num_processes} process(es))"
                )
            if step == args.steps:
                break

    if args.checkpoint:
        accelerator.save_state(args.checkpoint)
        accelerator.print(f"saved {args.checkpoint}; merge it with: hasten merge-weights {args.checkpoint} OUT")


if __name__ == "__main__":  # (tests import the model from here)
    main()
