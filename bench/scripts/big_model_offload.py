"""Row 20: greedy generate of a Llama with half its layers offloaded to disk ÷ all in memory, on hasten
(through ``install_as_accelerate()``) and on the real Accelerate, the same script.

A Llama built from a config (random weights, nothing from the hub) is saved once as safetensors
shards. Each run is a fresh process that loads it with transformers' ``from_pretrained``, either all
in memory (no device map) or with ``device_map`` sending the second half of its decoder layers to
``"disk"`` (an ``offload_folder``; the weights are read from the checkpoint's own safetensors files
for each forward and dropped after), then runs greedy ``generate`` (one warm-up, then ``--repeats``
timed, the median counts; timed by the main thread's CPU time, which with one intra-op thread is the
whole generate, reads of the offloaded weights included, and by the wall clock, which on a shared
machine swings with the others' load). A thread samples the process's RSS (and its anonymous part, which leaves
out the pages of mapped files) every few milliseconds while it generates; its peak is reported whole
and above the RSS the process had before loading the model (torch and transformers imported: the
model's share), and the process's peak RSS (``ru_maxrss``, loading included) too. The four runs of
a round (hasten / Accelerate × memory / disk) alternate, the order reversed every other round; a
round's ratios are disk ÷ memory for each library, and hasten ÷ Accelerate with the disk placement.
Greedy tokens must be the same in all four.

    python bench/scripts/big_model_offload.py --rounds 3 --out result.json
    python bench/scripts/big_model_offload.py --worker hasten disk FOLDER OUT.json   # one run (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import child_env, emit, summary  # noqa: E402

HERE = os.path.abspath(__file__)
LIBRARIES = ("hasten", "accelerate")
PLACEMENTS = ("memory", "disk")


def _status() -> dict[str, int]:
    """VmRSS and RssAnon of this process, in bytes (Linux)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as fp:
        for line in fp:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                found[key] = int(rest.split()[0]) * 1024
    return found


class Sampler(threading.Thread):
    """Samples the RSS every ``period`` seconds until stopped: the peak and the mean."""

    def __init__(self, period: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self.done = period, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(_status())
            time.sleep(self.period)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join()
        rss = [s["VmRSS"] for s in self.samples]
        anon = [s["RssAnon"] for s in self.samples]
        return {"peak": max(rss), "mean": statistics.fmean(rss), "anon_peak": max(anon), "n": len(rss)}


# ---------------------------------------------------------------------- one run (a child process)
def worker(library: str, placement: str, folder: str, out: str, new_tokens: int, repeats: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if library == "hasten":
        import hasten

        hasten.install_as_accelerate()
    import accelerate
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    kwargs = {}
    if placement == "disk":
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fp:
            layers = json.load(fp)["num_hidden_layers"]
        device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map |= {f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)}
        kwargs = {"device_map": device_map, "offload_folder": os.path.join(folder, f"offload-{library}")}
    before = _status()  # torch, transformers and the library imported; no model yet
    model = LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()
    loaded = _status()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    def generate() -> list[int]:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0]

    generate()  # warm-up
    sampler = Sampler()
    sampler.start()
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        tokens = generate()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    rss = sampler.stop()
    offloaded = [p.device.type for n, p in model.named_parameters() if ".layers." in n]
    emit(
        {
            "accelerate": accelerate.__file__,
            "generate_s": statistics.median(times),
            "generate_cpu_s": statistics.median(cpu),
            "rss_before": before["VmRSS"],
            "rss_loaded": loaded["VmRSS"],
            "rss": rss,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "meta_layer_fraction": offloaded.count("meta") / len(offloaded),
            "tokens": tokens.tolist(),
        },
        out,
    )


# ---------------------------------------------------------------------- the driver
def build(folder: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 256),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="64MB")
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers.parameters())
    return {
        "layers": args.layers,
        "width": args.width,
        "vocab": args.vocab,
        "parameters": params,
        "bytes": params * 4,
        "layer_fraction": layer / params,
        "shards": len([f for f in os.listdir(folder) if f.endswith(".safetensors")]),
    }


def run_one(library: str, placement: str, folder: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, HERE, "--worker", library, placement, folder, out]
        cmd += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{library} {placement} failed:\n" + "\n".join(done.stderr.splitlines()[-15:]))
        with open(out, encoding="utf-8") as fp:
            return json.load(fp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=4, metavar=("LIBRARY", "PLACEMENT", "FOLDER", "OUT"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: numbers meaningless")
    parser.add_argument("--no-others", action="store_true", help="hasten only (no run on Accelerate)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        library, placement, folder, out = args.worker
        worker(library, placement, folder, out, args.new_tokens, args.repeats)
        return
    if args.quick:
        args.rounds, args.layers, args.width, args.vocab, args.new_tokens, args.repeats = 1, 2, 64, 128, 2, 1
    libraries = LIBRARIES[:1] if args.no_others else LIBRARIES
    runs = [(lib, place) for lib in libraries for place in PLACEMENTS]
    found: dict[str, list[dict]] = {f"{lib}/{place}": [] for lib, place in runs}
    with tempfile.TemporaryDirectory() as folder:
        model = build(folder, args)
        for r in range(args.rounds):
            for lib, place in runs if r % 2 == 0 else runs[::-1]:
                found[f"{lib}/{place}"].append(run_one(lib, place, folder, args))
    tokens = {json.dumps(run["tokens"]) for runs_ in found.values() for run in runs_}
    result: dict = {"model": model, "rounds": args.rounds, "new_tokens": args.new_tokens, "repeats": args.repeats}
    result["same_tokens"] = len(tokens) == 1
    result["libraries"] = {}
    for lib in libraries:
        mem, disk = found[f"{lib}/memory"], found[f"{lib}/disk"]
        result["libraries"][lib] = {
            "time": summary([d["generate_cpu_s"] / m["generate_cpu_s"] for d, m in zip(disk, mem)]),
            "wall": summary([d["generate_s"] / m["generate_s"] for d, m in zip(disk, mem)]),
            "rss_generating": summary([d["rss"]["peak"] / m["rss"]["peak"] for d, m in zip(disk, mem)]),
            "model_rss_generating": summary([_above(d) / _above(m) for d, m in zip(disk, mem)]),
            "anon_generating": summary([d["rss"]["anon_peak"] / m["rss"]["anon_peak"] for d, m in zip(disk, mem)]),
            "ru_maxrss": summary([d["ru_maxrss"] / m["ru_maxrss"] for d, m in zip(disk, mem)]),
            "memory": _absolute(mem),
            "disk": _absolute(disk),
            "accelerate": disk[0]["accelerate"],
        }
    if not args.no_others:
        hst, acc = found["hasten/disk"], found["accelerate/disk"]
        result["hasten_vs_accelerate_disk"] = {
            "time": summary([h["generate_cpu_s"] / a["generate_cpu_s"] for h, a in zip(hst, acc)]),
            "rss_generating": summary([h["rss"]["peak"] / a["rss"]["peak"] for h, a in zip(hst, acc)]),
        }
    result["loadavg"] = list(os.getloadavg())
    emit(result, args.out)


def _above(run: dict) -> float:
    """The peak RSS while generating above the RSS before the model was loaded: the model's share."""
    return run["rss"]["peak"] - run["rss_before"]


def _absolute(runs: list[dict]) -> dict[str, float]:
    """Medians over rounds of one variant's own figures (seconds, bytes)."""
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    return {
        "generate_s": med(lambda r: r["generate_s"]),
        "generate_cpu_s": med(lambda r: r["generate_cpu_s"]),
        "rss_before": med(lambda r: r["rss_before"]),
        "rss_loaded": med(lambda r: r["rss_loaded"]),
        "rss_peak": med(lambda r: r["rss"]["peak"]),
        "rss_mean": med(lambda r: r["rss"]["mean"]),
        "anon_peak": med(lambda r: r["rss"]["anon_peak"]),
        "ru_maxrss": med(lambda r: r["ru_maxrss"]),
        "meta_layer_fraction": med(lambda r: r["meta_layer_fraction"]),
    }


if __name__ == "__main__":
    main()
