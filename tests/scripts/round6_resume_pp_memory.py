"""RSS of a pipeline-parallel run over many sequence lengths (issue 57): how much memory each process
keeps after it has seen LENGTHS different input shapes, against what Python's allocator holds
(tracemalloc) and the tensors torch holds.

usage: round6_resume_pp_memory.py OUT [LENGTHS] [REPEAT] [trim]

``trim``: also the RSS after glibc's ``malloc_trim(0)`` at each point (memory freed but kept by the
allocator is given back): what is left is what the process holds.

2 processes, pp 2 (1F1B, 2 microbatches), training steps (forward, backward, optimizer step) on
batches of 8 x length for LENGTHS distinct lengths, then the first lengths again REPEAT times.
Each process writes OUT/rank{r}.json: the RSS (VmRSS) after the first step and after every step,
tracemalloc's current size at the same points, and the schedules kept.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import tracemalloc

import torch
import torch.nn.functional as F
from torch import nn

from hasten import Accelerator, ParallelismConfig
from hasten.utils import TorchPipelineParallelConfig

VOCAB, DIM, LAYERS = 256, 256, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    out = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    trim = ctypes.CDLL("libc.so.6").malloc_trim if sys.argv[4:] == ["trim"] else None
    handler = TorchPipelineParallelConfig(schedule="1F1B", microbatches=2)
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(pp_size=2, pp_handler=handler))
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    lengths = [64 + 16 * i for i in range(count)]
    lengths += lengths[:4] * repeat
    tracemalloc.start()
    points = []
    for step, n in enumerate(lengths):
        x = torch.randint(VOCAB, (8, n), generator=g)
        loss = acc.pipeline_step(model, x, torch.roll(x, -1, dims=1), loss_fn)
        opt.step()
        opt.zero_grad()
        gc.collect()
        point = {"step": step, "length": n, "rss": rss(), "traced": tracemalloc.get_traced_memory()[0]}
        if trim is not None:
            trim(0)
            point["trimmed"] = rss()
        points.append(point)
        del loss
    from torch.distributed.pipelining import PipelineStage

    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, PipelineStage)]
    top = tracemalloc.take_snapshot().statistics("lineno")[:15]
    result = {
        "points": points,
        "growth": points[-1]["rss"] - points[0]["rss"],
        "traced_growth": points[-1]["traced"] - points[0]["traced"],
        "trimmed_growth": points[-1]["trimmed"] - points[0]["trimmed"] if trim is not None else None,
        "kept": len(getattr(model, "_schedules", {})),
        "stages_alive": len(alive),
        "top": [str(s) for s in top],
    }
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
