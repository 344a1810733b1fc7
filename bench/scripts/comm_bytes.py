"""Row 4: gradient communication per DDP communication hook: bytes all-reduced per step and the
final loss after N steps. Run under ``python -m torch.distributed.run --nproc_per_node 2``.

How bytes are counted: with ``torch.profiler`` on a few steady-state steps. Every all-reduce,
whether DDP's built-in one (C++, invisible to Python) or a hook's ``dist.all_reduce``, runs
through the gloo process group, which records a ``gloo:all_reduce`` range with the tensor's
dims and dtype; bytes = elements x element size, summed over the step. So the count is what
really crossed the process group, the same way for every hook, and the hooks run untouched
(a counting wrapper around a hook would see the bucket, not what the hook sends).

Expected bytes per step, from the model's gradients (N elements, fp32) as DDP buckets them:
``no`` 4N; fp16/bf16 2N; PowerSGD rank r: 4 r (m + n) for each m x n gradient matrix worth
compressing (torch's rule: (m + n) r x min_compression_rate < m n), 4 x numel for the rest
(biases); batched PowerSGD rank r: 4 x 2 r ceil(sqrt(b)) per bucket of b elements.
All hooks start compressing at step 2 (``start_powerSGD_iter=2``); every run starts from the
same weights and sees the same batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import emit, single_thread
from torch.utils.data import DataLoader, TensorDataset

BATCH = 32  # per process
IN, HIDDEN, OUT = 256, 1024, 64
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default
DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "int": 4, "long int": 8}

CONFIGS = [  # (label, comm_hook, comm_wrapper, rank)
    ("no", "no", "no", 0),
    ("fp16", "fp16", "no", 0),
    ("bf16", "bf16", "no", 0),
    ("power_sgd r=1", "power_sgd", "no", 1),
    ("power_sgd r=2", "power_sgd", "no", 2),
    ("batched_power_sgd r=1", "batched_power_sgd", "no", 1),
    ("power_sgd r=1 + fp16 wrapper", "power_sgd", "fp16", 1),
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def make_data(samples: int) -> tuple[TensorDataset, tuple[torch.Tensor, torch.Tensor]]:
    """A regression task with a real answer: targets from a fixed random teacher network."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, OUT))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        x = torch.randn(samples + 512, IN, generator=g)
        y = teacher(x)
    return TensorDataset(x[:samples], y[:samples]), (x[samples:], y[samples:])


def expected_bytes(model: torch.nn.Module, hook: str, wrapper: str, rank: int, buckets: list[int]) -> int:
    grads = [p for p in model.parameters() if p.requires_grad]
    if hook in ("no", "fp16", "bf16"):
        elements = sum(p.numel() for p in grads)
        size = 2 if "16" in hook else 4
    elif hook == "power_sgd":
        elements = 0
        for p in grads:
            if p.dim() <= 1:
                elements += p.numel()
                continue
            m, n = p.shape[0], p.numel() // p.shape[0]
            r = min(rank, m, n)
            elements += (m + n) * r if (m + n) * r * MIN_COMPRESSION_RATE < m * n else m * n
        size = 4
    else:  # batched: each bucket viewed as one square matrix
        elements = sum(2 * rank * math.ceil(math.sqrt(b)) for b in buckets)
        size = 4
    if wrapper in ("fp16", "bf16"):
        size = 2
    return elements * size


def allreduce_bytes(trace_file: str) -> tuple[int, list[int]]:
    """Bytes all-reduced in a Chrome trace, and the element count of each message."""
    with open(trace_file, encoding="utf-8") as fp:
        events = json.load(fp)["traceEvents"]
    total, messages = 0, []
    for ev in events:
        if ev.get("name") != "gloo:all_reduce":
            continue
        args = ev.get("args", {})
        for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", [])):
            elements = math.prod(dims) if dims else 1
            total += elements * DTYPE_BYTES[dtype]
            messages.append(elements)
    return total, messages


def run(config: tuple, steps: int, measured_steps: int, data, eval_set, workdir: str) -> dict:
    from hasten import Accelerator, DistributedDataParallelKwargs

    label, hook, wrapper, rank = config
    state = {"matrix_approximation_rank": rank, "start_powerSGD_iter": 2} if "power_sgd" in hook else {}
    handler = DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper, comm_state_option=state)
    acc = Accelerator(cpu=True, kwargs_handlers=[handler])
    model = make_model()
    torch.manual_seed(2)  # same shuffling for every config
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        DataLoader(data, batch_size=BATCH, shuffle=True),
    )
    trace = os.path.join(workdir, f"{hook}-{wrapper}-{rank}-rank{acc.process_index}.json")
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        record_shapes=True,
        # PowerSGD sends P and Q from future callbacks, on gloo's threads: record those too.
        experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
    )
    done = 0
    while done < steps:
        for x, y in loader:
            if done == steps - measured_steps:
                profiler.start()
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            done += 1
            if done == steps:
                break
    profiler.stop()
    profiler.export_chrome_trace(trace)
    total, messages = allreduce_bytes(trace)
    with torch.no_grad():
        final = F.mse_loss(model(eval_set[0]), eval_set[1]).item()
    return {
        "label": label,
        "hook": hook,
        "wrapper": wrapper,
        "rank": rank,
        "bytes_per_step": total / measured_steps,
        "messages_per_step": len(messages) / measured_steps,
        "messages": messages[: len(messages) // measured_steps],
        "final_loss": final,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150, help="training steps per hook")
    parser.add_argument("--measured", type=int, default=3, help="last steps profiled for the byte count")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--no-others", action="store_true", help="accepted for the driver; this row is hasten's alone")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not 1 <= args.measured <= args.steps - 3:
        parser.error(
            f"--measured must be between 1 and --steps - 3 (compression starts at step 2), got {args.measured}"
        )
    single_thread()
    warnings.filterwarnings("ignore")
    data, eval_set = make_data(args.samples)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for config in CONFIGS:
            rows.append(run(config, args.steps, args.measured, data, eval_set, workdir))
    if dist.get_rank() == 0:
        buckets = rows[0]["messages"]  # DDP's own buckets: one message each with no hook
        inner = make_model()
        for r in rows:
            r.pop("messages")
            r["expected_bytes_per_step"] = expected_bytes(inner, r["hook"], r["wrapper"], r["rank"], buckets)
        for r in rows:  # how many times fewer bytes than with no hook
            r["cut"] = rows[0]["bytes_per_step"] / r["bytes_per_step"]
            r["expected_cut"] = rows[0]["expected_bytes_per_step"] / r["expected_bytes_per_step"]
        shapes = [list(p.shape) for p in inner.parameters()]
        emit(
            {
                "row": "comm_bytes",
                "steps": args.steps,
                "measured_steps": args.measured,
                "param_shapes": shapes,
                "buckets": buckets,
                "hooks": rows,
            },
            args.out,
        )
    dist.barrier()


if __name__ == "__main__":
    main()
