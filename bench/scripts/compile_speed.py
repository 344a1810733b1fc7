"""Row 7: torch.compile with inductor on a small transformer (CPU, one process).

- step time of hasten compiled (``Accelerator(dynamo_backend="inductor")``) ÷ a hand-written
  ``torch.compile`` loop, and compiled ÷ eager (hasten), interleaved (see _harness);
- cold compile time, regional (each of the 8 blocks) ÷ whole model: the first forward+backward
  of a fresh model in a fresh compile cache, each variant in a process of its own, alternated.
  Each child also reports what it compiled: Dynamo graphs and recompiles (regional must compile
  one graph, shared by the 8 blocks, forward and backward once) and the C++ kernels inductor
  built (the ``.so`` files in its fresh cache, the vector-ISA probe among them). Inductor's
  precompiled header (``cpp_prefix.h``, ~150 MB, in the *default* cache dir, not in
  TORCHINDUCTOR_CACHE_DIR) is built once per machine: the hand-written loop above builds it
  before the cold runs, so neither variant pays it.

  Why regional is not 1/8 of whole: inductor gives identical kernels one name in a graph, so the
  whole model's 8 blocks build ~23 C++ kernels, not 8x the block's ~12, and g++ (~1 s a kernel
  here) is most of a cold compile; with a per-process fixed cost (~6 s: inductor's first
  compile, the header check, the vector-ISA probe) on both sides, only Dynamo/AOT/inductor's
  Python work scales with the blocks. On a quiet machine regional ÷ whole is ~0.45-0.5.
- Accelerate's compile (``dynamo_backend="inductor"``) step time ÷ the hand-written loop, where
  Accelerate is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _harness  # noqa: E402

BLOCKS = 8


def make_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int = 64) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(128, 64)
            self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(64, 128)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def cold(mode: str, backend: str) -> dict:
    """Seconds to the end of the first compiled step, in this (fresh) process, and what it compiled."""
    import glob

    import torch

    from hasten import Accelerator, TorchDynamoPlugin

    torch.set_num_threads(1)
    plugin = TorchDynamoPlugin(backend=backend, use_regional_compilation=mode == "regional")
    acc = Accelerator(dynamo_plugin=plugin)
    model = acc.prepare(make_model())
    tokens = torch.randint(0, 128, (8, 32))
    start = time.perf_counter()
    acc.backward(model(tokens).float().pow(2).mean())
    seconds = time.perf_counter() - start
    from torch._dynamo.utils import counters

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return {
        "seconds": seconds,
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "backward_compiles": counters["aot_autograd"]["total"],
        "kernels": len(glob.glob(os.path.join(cache, "**", "*.so"), recursive=True)) if cache else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cold-rounds", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true")
    parser.add_argument("--backend", default="inductor", help="inductor (the row); aot_eager for a smoke run")
    parser.add_argument("--cold", choices=["whole", "regional"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold:
        print(json.dumps(cold(args.cold, args.backend)))
        return

    import torch

    from hasten import Accelerator

    _harness.single_thread()
    tokens = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))

    def loop(model, opt, backward):
        def epoch():
            for _ in range(1000):
                loss = model(tokens).float().pow(2).mean()
                backward(loss)
                opt.step()
                opt.zero_grad()
                yield loss

        return epoch

    raw_model = torch.compile(make_model(), backend=args.backend)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-4)
    acc = Accelerator(dynamo_backend=args.backend)
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    eager_acc = Accelerator()
    eager = make_model()
    eager, eager_opt = eager_acc.prepare(eager, torch.optim.AdamW(eager.parameters(), lr=1e-4))
    loops = {
        "raw_compiled": loop(raw_model, raw_opt, lambda loss: loss.backward()),
        "hasten_compiled": loop(model, opt, acc.backward),
        "hasten_eager": loop(eager, eager_opt, eager_acc.backward),
    }
    if not args.no_others:
        try:
            import accelerate

            a_acc = accelerate.Accelerator(cpu=True, dynamo_backend=args.backend)
            a_model = make_model()
            a_model, a_opt = a_acc.prepare(a_model, torch.optim.AdamW(a_model.parameters(), lr=1e-4))
            loops["accelerate_compiled"] = loop(a_model, a_opt, a_acc.backward)
        except ImportError:
            pass
    times = _harness.interleave_steps(loops, rounds=args.rounds, steps=args.steps, warmup=3)
    result = {
        "hasten_vs_raw": _harness.ratio_summary(times, "raw_compiled", "hasten_compiled"),
        "compiled_vs_eager": _harness.ratio_summary(times, "hasten_eager", "hasten_compiled"),
        "step_ms": {k: 1000 * _harness.summary(v)["median"] for k, v in times.items()},
    }
    if "accelerate_compiled" in times:
        result["accelerate_vs_raw"] = _harness.ratio_summary(times, "raw_compiled", "accelerate_compiled")

    colds: dict[str, list[float]] = {"whole": [], "regional": []}
    compiled: dict[str, dict] = {}
    for r in range(args.cold_rounds):
        for mode in ("whole", "regional") if r % 2 == 0 else ("regional", "whole"):
            with tempfile.TemporaryDirectory() as cache:  # a cold cache each time
                env = {**_harness.child_env(), "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
                out = subprocess.run(
                    [sys.executable, __file__, "--cold", mode, "--backend", args.backend],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=900,
                )
                child = json.loads(out.stdout.strip().splitlines()[-1])
                colds[mode].append(child.pop("seconds"))
                compiled[mode] = child  # the same in every round (a change would be a finding)
    result["cold_s"] = {k: _harness.summary(v)["median"] for k, v in colds.items()}
    result["cold_compiled"] = compiled
    result["regional_vs_whole_cold"] = _harness.summary([r / w for r, w in zip(colds["regional"], colds["whole"])])
    _harness.emit(result, args.out)


if __name__ == "__main__":
    main()
