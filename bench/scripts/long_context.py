"""Row 18: long context (issue 51) on 2 gloo processes: Ulysses sequence parallelism's activation
memory per process and step time, and selective activation checkpointing's memory and step time.
Run under ``python -m torch.distributed.run --nproc_per_node 2`` (``--quick`` for a smoke run).

The model: a small transformers ``LlamaForCausalLM`` (sdpa attention; ``--hidden`` 256,
``--layers`` 2, ``--heads`` 8, ``--intermediate`` 512, ``--vocab`` 1024, untied head; ~1.8M
parameters, so the activations are what grows), built with the same seed on every process, one
sequence of ``L`` tokens per step, ``shift_labels`` the tokens shifted by one (-100 at the end).
Every model is sharded with FSDP2 over the same 2 processes (each ``LlamaDecoderLayer``, then the
root); the optimizer is AdamW.

- ``memory``, per sequence length (``--lengths``, 1k / 4k / 16k): three variants, each one
  forward + backward after an untimed warm-up step:

  - ``sp1``: hasten without sp, ``ParallelismConfig(dp_shard_size=2)``: FSDP 2, each process a
    whole sequence of its own (the same processes and sharding, no sequence split);
  - ``sp2``: hasten's Ulysses, ``ParallelismConfig(sp_size=2, sp_backend="torch")``: the two
    processes share one sequence, each holds half of it inside ``maybe_context_parallel``;
  - ``hand``: the hand-written Ulysses loop below (for reference).

  Per process, three figures: ``saved``, the bytes autograd saves for backward during the forward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage once, the parameters' left out: the
  activation memory proper); ``alive``, the bytes of every tensor the forward made that is still
  alive when it returns (a ``TorchDispatchMode`` noting each op's output storage, each once, the
  parameters' left out), which also sees inside checkpointed blocks (a non-reentrant checkpoint
  packs through saved-tensor hooks of its own); ``peak``, the peak RSS during forward + backward
  above the RSS just before the forward (``/proc/self/clear_refs`` resets the high-water mark,
  glibc told by ``mallopt`` to return freed memory at once, as row 8's launches are by their
  environment, so RSS follows live memory). The largest process's figure is kept.
- ``time``, at ``--time-length`` tokens: hasten's sp 2 (``accelerator.maybe_context_parallel``
  around forward and ``accelerator.backward``, the model's own loss) interleaved with the
  hand-written loop and an identical second hand-written loop (the A/A control), blocks of
  ``--steps`` steps in a seeded shuffled order (_harness.interleave_steps), rank 0's block
  medians; beside the wall clock, each block's median CPU time (``time.process_time``, which a
  loaded machine's waits for a core do not inflate). The hand-written loop is plain torch +
  transformers: the attention registered as a transformers attention function that exchanges
  q, k, v head-for-sequence and the output back with ``dist.all_to_all_single`` in an
  ``autograd.Function`` (DeepSpeed-Ulysses), around transformers' own sdpa attention; the
  slice's global ``position_ids`` passed in;
  ``fully_shard`` on each decoder layer and the root over a 1-D mesh of the 2 processes (hasten's
  ``dp_shard_cp`` holds the same 2); the token-weighted loss: the tokens counted are all-reduced
  and given as ``num_items_in_batch`` (÷ 2, FSDP averages the two ranks' gradients). Both loops'
  first step runs on the same weights and batch: their whole-sequence losses must agree.
- ``ac``, at ``--ac-length`` tokens, FSDP 2 without sp (each process a sequence of its own):
  ``FullyShardedDataParallelPlugin(activation_checkpointing=...)`` none, ``"selective"``,
  selective with ``selective_save="every_other_matmul"`` and ``"full"`` (``"memory_budget"``
  needs ``torch.compile``: left out): ``alive`` and ``peak`` as above (``saved`` is blind inside
  checkpoints), and the step time interleaved as above, each ÷ none; every mode must reach the
  same loss after the same steps.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit, interleave_steps, ratio_summary, single_thread, summary  # noqa: E402

AC_MODES = ("none", "selective", "every_other_matmul", "full")
HAND_ATTENTION = "hand_ulysses"


# ---------------------------------------------------------------------- memory
def return_freed_memory() -> dict[str, int]:
    """glibc told to return freed memory at once (as fsdp_memory.MALLOC_ENV does at a launch):
    large blocks mapped on their own, no trim threshold, one arena; so RSS follows live memory."""
    settings = {"M_TRIM_THRESHOLD": (-1, 0), "M_MMAP_THRESHOLD": (-3, 65536), "M_ARENA_MAX": (-8, 1)}
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return {}
    return {name: value for name, (param, value) in settings.items() if libc.mallopt(param, value) == 1}


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fp:
        return int(fp.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """The RSS high-water mark (VmHWM) set to the RSS now; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fp:
            fp.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fp:
        for line in fp:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _storage_ptrs(model: torch.nn.Module) -> set[int]:
    """The storages of the parameters as the modules hold them now (FSDP2: the unsharded ones
    while gathered, which the forward's saved weights point at)."""
    ptrs = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


class _Made(TorchDispatchMode):
    """Notes the storage of every tensor an op makes (a storage keeps its Python object while alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    self.made.append(weakref.ref(t.untyped_storage()))
                except (RuntimeError, TypeError):  # a wrapper subclass without a storage of its own
                    pass
        return out


class Meter:
    """One forward + backward's activation memory (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.figures: dict[str, int] = {}

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        gc.collect()
        self.peak_ok = reset_peak()
        self.start = rss_bytes()
        saved: dict[int, Any] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            saved[s.data_ptr()] = s
            return t

        made = _Made()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), made:
            yield
        params = _storage_ptrs(self.model)
        # FSDP2 frees a resharded layer's gathered weights (its storages shrink to 0 bytes)
        kept = {p: s.nbytes() for p, s in saved.items() if p not in params and s.nbytes()}
        saved.clear()
        gc.collect()
        alive: dict[int, int] = {}
        for ref in made.made:
            s = ref()
            if s is not None and s.nbytes() and s.data_ptr() not in params:
                alive[s.data_ptr()] = s.nbytes()
        self.figures = {"saved": sum(kept.values()), "alive": sum(alive.values())}

    def after_backward(self) -> None:
        self.figures["peak"] = peak_bytes() - self.start if self.peak_ok else 0


# ---------------------------------------------------------------------- the model and data
def llama(args: argparse.Namespace, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.lengths + [args.time_length, args.ac_length]),
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = attn  # read at each forward (attention and mask)
    return model


def batch(args: argparse.Namespace, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)


# ---------------------------------------------------------------------- the hand-written Ulysses
class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0; backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def heads_for_sequence(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(batch, heads, my slice, dim) -> (batch, my heads / n, whole sequence, dim)."""
    b, h, s, d = x.shape
    got = _AllToAll.apply(x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous(), group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def sequence_for_heads(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(batch, whole sequence, heads / n, dim) -> (batch, my slice, heads, dim)."""
    b, length, h, d = x.shape
    got = _AllToAll.apply(x.reshape(b, n, length // n, h, d).transpose(0, 1).contiguous(), group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, length // n, n * h, d)


def register_hand_attention(group: Any, n: int) -> None:
    """transformers' sdpa attention with q, k, v exchanged before it and its output after it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        q, k, v = (heads_for_sequence(t, group, n) for t in (query, key, value))
        out, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)
        return sequence_for_heads(out, group, n), None

    AttentionInterface.register(HAND_ATTENTION, attention)


# ---------------------------------------------------------------------- the variants
Step = Callable[..., torch.Tensor]


def hasten_variant(args: argparse.Namespace, sp: int, mode: str = "none") -> tuple[Any, torch.nn.Module, Any]:
    from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from hasten.settings.activation_checkpointing import ActivationCheckpointingConfig

    checkpointing: Any = None
    if mode == "every_other_matmul":
        checkpointing = ActivationCheckpointingConfig("selective", selective_save="every_other_matmul")
    elif mode != "none":
        checkpointing = mode
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    pc = ParallelismConfig(sp_size=sp, sp_backend="torch") if sp > 1 else ParallelismConfig(dp_shard_size=world)
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=checkpointing
    )
    acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin)
    model = llama(args)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return acc, model, opt


def hasten_step(acc: Any, model: torch.nn.Module, opt: Any, split: bool) -> Step:
    """One step: forward (the model's own, token-weighted loss) and ``accelerator.backward``
    inside ``maybe_context_parallel`` (with ``split``), then AdamW."""

    def step(ids: torch.Tensor, labels: torch.Tensor, meter: Meter | None = None, update: bool = True):
        opt.zero_grad()
        ctx = (
            acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1])
            if split
            else contextlib.nullcontext()
        )
        with ctx:
            with meter.forward() if meter else contextlib.nullcontext():
                loss = model(input_ids=ids, shift_labels=labels, labels=labels).loss
            acc.backward(loss)
        if meter:
            meter.after_backward()
        if update:
            opt.step()
        return loss.detach()

    return step


def hand_variant(args: argparse.Namespace, mesh: Any) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    model = llama(args, HAND_ATTENTION)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def hand_step(model: torch.nn.Module, opt: Any, group: Any) -> Step:
    """One step of the hand-written Ulysses loop: this rank's slice, its global positions, the
    token-weighted loss (tokens counted over the group), ``loss.backward()``, AdamW. The loss
    returned is this slice's share × 2 (the whole sequence's is their mean over the ranks)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)

    def step(ids: torch.Tensor, labels: torch.Tensor, meter: Meter | None = None, update: bool = True):
        opt.zero_grad()
        local = ids.shape[1] // n
        mine = slice(rank * local, (rank + 1) * local)
        my_ids, my_labels = ids[:, mine].contiguous(), labels[:, mine].contiguous()
        positions = torch.arange(rank * local, (rank + 1) * local).unsqueeze(0)
        count = (my_labels != -100).sum().to(torch.float32)
        dist.all_reduce(count, group=group)
        with meter.forward() if meter else contextlib.nullcontext():
            loss = model(
                input_ids=my_ids,
                position_ids=positions,
                labels=my_labels,
                shift_labels=my_labels,
                num_items_in_batch=count / n,
            ).loss
        loss.backward()
        if meter:
            meter.after_backward()
        if update:
            opt.step()
        return loss.detach()

    return step


# ---------------------------------------------------------------------- the parts
def largest(figures: dict[str, int]) -> dict[str, int]:
    """Each figure's largest value over the processes."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    return {k: max(f[k] for f in every) for k in figures}


def measure(step: Step, model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, int]:
    meter = Meter(model)
    step(ids, labels, meter, update=False)
    dist.barrier()
    return largest(meter.figures)


def memory_part(args: argparse.Namespace, variants: dict[str, tuple[Step, torch.nn.Module]]) -> list[dict]:
    rank = dist.get_rank()
    warm = min(args.lengths)
    for name, (step, _) in variants.items():  # FSDP's lazy init, the first calls' caches
        step(*batch(args, warm, rank if name == "sp1" else 0), update=False)
    out = []
    for length in args.lengths:
        cell: dict[str, Any] = {"length": length}
        for name, (step, model) in variants.items():
            seed = 1000 + length + (rank if name == "sp1" else 0)  # sp1: each process a sequence of its own
            cell[name] = measure(step, model, *batch(args, length, seed))
        cell["sp2_vs_sp1"] = {k: cell["sp2"][k] / cell["sp1"][k] for k in cell["sp1"] if cell["sp1"][k]}
        cell["sp2_vs_hand"] = {k: cell["sp2"][k] / cell["hand"][k] for k in cell["hand"] if cell["hand"][k]}
        out.append(cell)
        if rank == 0:
            print(f"memory at {length}: {cell}", flush=True)
    return out


def loop(step: Step, ids: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor], cpu: list[float]) -> Callable:
    """A training loop for interleave_steps; each step's loss and its CPU time (this process's,
    all threads: what a loaded machine's waits for a core do not inflate) noted."""

    def epoch() -> Iterator[None]:
        for _ in range(1000):
            start = time.process_time()
            losses.append(step(ids, labels))
            cpu.append(time.process_time() - start)
            yield None

    return epoch


def cpu_blocks(cpu: dict[str, list[float]], rounds: int, steps: int, warmup: int = 1) -> dict[str, list[float]]:
    """The CPU times regrouped as interleave_steps ran them: after ``warmup`` steps, per round a
    switch step and a block of ``steps``; each block's median."""
    return {
        name: [median(t[warmup + r * (steps + 1) + 1 : warmup + (r + 1) * (steps + 1)]) for r in range(rounds)]
        for name, t in cpu.items()
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


def time_part(args: argparse.Namespace, hasten: Step, hands: dict[str, Step], group: Any) -> dict:
    ids, labels = batch(args, args.time_length, 7)  # the same sequence on both processes (one sp group)
    # the first step of each on the same weights and batch: the whole sequence's loss must agree
    first = {"hasten": float(hasten(ids, labels))}
    for name, step in hands.items():
        share = step(ids, labels)
        dist.all_reduce(share, group=group)
        first[name] = float(share) / dist.get_world_size(group)
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in ("hasten", *hands)}
    cpu: dict[str, list[float]] = {name: [] for name in losses}
    loops = {"hasten": loop(hasten, ids, labels, losses["hasten"], cpu["hasten"])}
    loops.update({name: loop(step, ids, labels, losses[name], cpu[name]) for name, step in hands.items()})
    times = interleave_steps(loops, rounds=args.rounds, steps=args.steps, warmup=1)
    cpu_times = cpu_blocks(cpu, args.rounds, args.steps)
    return {
        "length": args.time_length,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "step_s": {name: summary(t) for name, t in times.items()},
        "hand_step_s": median(times["hand"]),
        "step_vs_hand": ratio_summary(times, "hand", "hasten"),
        "hand_again": ratio_summary(times, "hand", "hand_again"),
        "cpu_s": {name: summary(t) for name, t in cpu_times.items()},
        "cpu_vs_hand": ratio_summary(cpu_times, "hand", "hasten"),
        "cpu_hand_again": ratio_summary(cpu_times, "hand", "hand_again"),
        "first_loss": first,
        "same_first_loss": abs(first["hasten"] - first["hand"]) <= 1e-5 * max(1.0, abs(first["hand"])),
        "steps_run": {name: len(v) for name, v in losses.items()},
    }


def ac_part(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    ids, labels = batch(args, args.ac_length, 2000 + rank)  # each process a sequence of its own
    steps, models = {}, {}
    for mode in args.ac_modes:
        acc, model, opt = hasten_variant(args, 1, mode)
        steps[mode], models[mode] = hasten_step(acc, model, opt, split=False), model
    memory = {}
    for mode in args.ac_modes:  # warm-up, then one measured forward + backward
        steps[mode](ids, labels, update=False)
        memory[mode] = measure(steps[mode], models[mode], ids, labels)
        if rank == 0:
            print(f"ac {mode}: {memory[mode]}", flush=True)
    losses: dict[str, list[torch.Tensor]] = {mode: [] for mode in args.ac_modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in args.ac_modes}
    loops = {mode: loop(steps[mode], ids, labels, losses[mode], cpu[mode]) for mode in args.ac_modes}
    times = interleave_steps(loops, rounds=args.ac_rounds, steps=args.steps, warmup=1)
    cpu_times = cpu_blocks(cpu, args.ac_rounds, args.steps)
    last = {mode: float(v[-1]) for mode, v in losses.items()}
    base = args.ac_modes[0]
    return {
        "length": args.ac_length,
        "rounds": args.ac_rounds,
        "steps_per_block": args.steps,
        "memory": memory,
        "step_s": {mode: summary(t) for mode, t in times.items()},
        "vs_none": {
            mode: {
                **{k: memory[mode][k] / memory[base][k] for k in ("alive", "peak") if memory[base][k]},
                "step": ratio_summary(times, base, mode),
                "cpu": ratio_summary(cpu_times, base, mode),
            }
            for mode in args.ac_modes
            if mode != base
        },
        "last_loss": last,
        # every mode computes the same gradients: the same weights after the same steps
        "losses_agree": all(abs(v - last[base]) <= 1e-4 * max(1.0, abs(last[base])) for v in last.values())
        and len({len(v) for v in losses.values()}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: short sequences, one round")
    parser.add_argument("--lengths", default="1024,4096,16384", help="the memory part's sequence lengths")
    parser.add_argument("--time-length", type=int, default=4096)
    parser.add_argument("--ac-length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10, help="the time part's rounds")
    parser.add_argument("--ac-rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per block")
    parser.add_argument("--ac-modes", default=",".join(AC_MODES))
    parser.add_argument("--parts", default="memory,time,ac")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--out")
    parser.add_argument("--no-others", action="store_true", help="(accepted; no other library runs here)")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.time_length, args.ac_length = "256,512,1024", 512, 512
        args.rounds, args.ac_rounds, args.steps = 2, 1, 1
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.ac_modes = [m for m in args.ac_modes.split(",") if m]
    if args.ac_modes[0] != "none":
        args.ac_modes.insert(0, "none")
    parts = set(args.parts.split(","))
    malloc = return_freed_memory()
    single_thread()

    from torch.distributed.device_mesh import init_device_mesh

    acc, model, opt = hasten_variant(args, 2)  # starts the process group
    rank, world = dist.get_rank(), dist.get_world_size()
    sp2 = hasten_step(acc, model, opt, split=True)
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    register_hand_attention(group, world)
    hands = {}
    for name in ("hand", "hand_again"):
        hand_model, hand_opt = hand_variant(args, mesh)
        hands[name] = (hand_step(hand_model, hand_opt, group), hand_model)
    result: dict[str, Any] = {
        "model": {
            "params": sum(p.numel() for p in llama(args).parameters()),
            **{k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads")},
        },
        "processes": world,
        "malloc": malloc,
        "peak_measured": reset_peak(),
    }
    if "memory" in parts:
        acc1, model1, opt1 = hasten_variant(args, 1)
        variants = {
            "sp1": (hasten_step(acc1, model1, opt1, split=False), model1),
            "sp2": (sp2, model),
            "hand": hands["hand"],
        }
        result["memory"] = memory_part(args, variants)
    if "time" in parts:
        result["time"] = time_part(args, sp2, {name: step for name, (step, _) in hands.items()}, group)
        if rank == 0:
            print(f"time: {result['time']}", flush=True)
    if "ac" in parts:
        result["ac"] = ac_part(args)
    result["loadavg"] = list(os.getloadavg())
    if rank == 0:
        emit(result, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
