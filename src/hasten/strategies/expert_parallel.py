"""Expert parallelism (EP): each MoE layer's experts split over the ``ep`` mesh dim, tokens sent to
their experts by an all-to-all and back (torchtitan's semantics, its ``AllToAllTokenDispatcher``).

``ep`` is carved out of the data-parallel sharding dim: ``dp_shard = efsdp x ep``
(``ParallelismConfig.ep_size``). The ranks of an ep group read different batches; each holds
``num_experts / ep_size`` experts of every MoE layer (the 3-D weights as DTensors ``Shard(0)`` on
``ep``), which FSDP2 then shards further over ``efsdp`` (``fsdp.apply_fsdp``); everything that is
not an expert is sharded over the whole data dims as without EP. Where ``efsdp`` (with HSDP,
``dp_replicate x efsdp``) is one process, FSDP leaves the experts out (:func:`needs_fsdp`): it
would have nothing to shard or reduce, and its one-process all-gather and reduce-scatter copied
every expert in and out each step, with its hooks (measured: ~10% of an ep-4 step's CPU time in
``bench/scripts/moe_ep.py``); their forward casts them to FSDP's ``param_dtype`` instead.

The experts module keeps its names and parameters; only its ``forward`` is replaced (on the
instance), so state dicts keep the model's own keys. The new forward takes what transformers'
experts take, ``(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``:

1. the (token, k) pairs are sorted by expert; the number each expert gets is sent to its owner
   first (an all-to-all of counts), then the tokens (an all-to-all with uneven splits);
2. the owner regroups what it received by local expert and runs its experts: one
   ``torch._grouped_mm`` per weight matrix (offsets from the counts, no host sync) where it runs,
   else a loop over the local experts (:func:`uses_grouped_mm`). Which one is decided once per
   (device type, dtype), at the first forward: ``torch._grouped_mm`` must run there forward and
   backward and agree with matmuls (:func:`grouped_mm_works`; on torch 2.13's CPU it runs fp32,
   bf16 and fp16, bit-equal to the loop and measured 1.1-2.4x faster than it, forward and
   backward, at H 32-128, I 64-256, 2-4 local experts, so the CPU uses it too; on CUDA the same
   probe decides, not measured here), and every row of the weights must be 16-byte aligned,
   which it requires. The loop runs
   under autocast (``_grouped_mm`` has no autocast rule), for inputs of another dtype, and
   compiled in a dtype other than bf16 (its meta kernel, which the compiler traces, takes bf16
   only);
3. the reverse all-to-all brings each result back, where it is weighted and summed over k.

Nothing is dropped, so the result is that of one process holding every expert. A rank with no
tokens (an empty batch) sends none and still takes part in both all-to-alls. The gradient of
an expert arrives summed over its ep group's data ranks: it is scaled by ``1 / ep_size`` on its
way to the weights, and FSDP's mean over ``efsdp`` (where FSDP manages the experts) then makes it
the mean over every data-parallel rank, as the other parameters' gradients are (FSDP's own divide
factor would need a reduce op that gloo lacks). Per step the forward syncs with the host once
(the split sizes the all-to-all needs, one ``tolist``; the loop needs a second, its experts'
row counts); the rest is decided at ``prepare`` or at the first forward.

Which modules are experts: those named by ``TorchExpertParallelConfig.experts`` (module-name
patterns, ``*`` for one name, or class names); else the model's own ``_ep_plan`` or its
``config.base_model_ep_plan`` (transformers' ``"ep_dispatch_experts"`` entries); else every module
holding 3-D ``gate_up_proj`` and ``down_proj`` parameters. An experts module must have
transformers' layout: ``gate_up_proj`` ``[E, 2 I, H]`` (gate then up), ``down_proj`` ``[E, H, I]``,
``act_fn``, no biases.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

#: transformers' value for an experts module in ``base_model_ep_plan``
EP_PLAN_EXPERTS = "ep_dispatch_experts"


@dataclass(frozen=True)
class ExpertParallelPlan:
    """Expert parallelism on the run's mesh (decided once, at ``Accelerator(...)``)."""

    #: the ``ep`` dim (the experts split over it) and what FSDP shards them over: ``efsdp``, or
    #: ``(dp_replicate, efsdp)`` for HSDP
    ep_mesh: Any
    efsdp_mesh: Any
    ep_size: int
    #: the user's declaration: module-name patterns or class names (None: the model's own)
    experts: tuple[str, ...] | None = None


# ---------------------------------------------------------------------------- which modules
def find_experts(module: nn.Module, plan: ExpertParallelPlan) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``module`` (name, module), checked: each has transformers' layout and
    a number of experts ``ep_size`` divides. Nothing is changed; a bad model is a ValueError."""
    named = list(module.named_modules())
    if plan.experts is not None:
        found = [(n, m) for n, m in named if n and _declared(n, m, plan.experts)]
        where = f"TorchExpertParallelConfig(experts={list(plan.experts)!r})"
    else:
        patterns = model_ep_patterns(module)
        if patterns:
            found = [(n, m) for n, m in named if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
            where = f"the model's expert-parallel plan ({', '.join(patterns)})"
        else:
            found = [(n, m) for n, m in named if _has_expert_weights(m)]
            where = "modules holding 3-D gate_up_proj and down_proj parameters"
    if not found:
        raise ValueError(
            f"ParallelismConfig(ep_size={plan.ep_size}) needs expert modules, but {type(module).__name__} has none "
            f"({where} found nothing): pass a MoE model, or name its experts modules with "
            "ParallelismConfig(ep_handler=TorchExpertParallelConfig(experts=['layers.*.mlp.experts']))"
        )
    for name, m in found:
        check_experts(name, m, plan.ep_size)
    return found


def _declared(name: str, module: nn.Module, declared: tuple[str, ...]) -> bool:
    """A module named by a pattern, or of a class named, in the user's declaration."""
    return any(fnmatch.fnmatchcase(name, d) or type(module).__name__ == d for d in declared)


def _has_expert_weights(module: nn.Module) -> bool:
    params = module._parameters
    return all(params.get(n) is not None and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def model_ep_patterns(module: nn.Module) -> list[str]:
    """The experts modules' name patterns (``*`` for one name) that the model declares: its
    ``_ep_plan``, else its config's ``base_model_ep_plan`` below ``base_model_prefix``."""
    plan = getattr(module, "_ep_plan", None)
    prefix = ""
    if not plan:
        plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        base = getattr(module, "base_model_prefix", "")
        prefix = f"{base}." if base and hasattr(module, base) else ""
    if not isinstance(plan, dict):
        return []
    return [prefix + k for k, style in plan.items() if style == EP_PLAN_EXPERTS]


def check_experts(name: str, module: nn.Module, ep_size: int) -> None:
    """An experts module EP can split: transformers' layout, ``ep_size`` dividing its experts."""
    if not _has_expert_weights(module) or not hasattr(module, "act_fn"):
        raise ValueError(
            f"expert parallelism: module {name!r} ({type(module).__name__}) is not an experts module hasten can "
            "split: it needs 3-D parameters gate_up_proj [E, 2*I, H] and down_proj [E, H, I] and an act_fn "
            "(transformers' layout), and forward(hidden_states, top_k_index, top_k_weights)"
        )
    layout = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True}
    layout["has_post_expert_norm"] = False
    odd = {k: getattr(module, k) for k, want in layout.items() if getattr(module, k, want) != want}
    if odd:
        raise ValueError(
            f"expert parallelism: module {name!r} ({type(module).__name__}) has a layout hasten's expert-parallel "
            f"forward does not run ({', '.join(f'{k}={v}' for k, v in odd.items())}); supported: "
            f"{', '.join(f'{k}={v}' for k, v in layout.items())}"
        )
    if any(isinstance(p, DTensor) for p in (module.gate_up_proj, module.down_proj)):
        raise ValueError(
            f"expert parallelism: the experts of {name!r} ({type(module).__name__}) are DTensors already (split by "
            "the user or another parallelism); pass a model whose experts are plain parameters"
        )
    experts = module.gate_up_proj.shape[0]
    if experts % ep_size or module.down_proj.shape[0] != experts:
        raise ValueError(
            f"ParallelismConfig(ep_size={ep_size}) must divide the number of experts, but {name!r} has {experts} "
            f"(down_proj: {module.down_proj.shape[0]}); choose an ep_size that divides {experts}"
        )


# ---------------------------------------------------------------------------- the step
def apply_expert_parallel(experts: list[tuple[str, nn.Module]], plan: ExpertParallelPlan) -> None:
    """Each experts module's weights become DTensors ``Shard(0)`` on ``ep`` (this rank's experts
    only; on the meta device where FSDP shards, so nothing is allocated or sent) and its forward
    dispatches tokens by all-to-all."""
    rank = plan.ep_mesh.get_local_rank()
    group = plan.ep_mesh.get_group()
    for _, module in experts:
        for pname in ("gate_up_proj", "down_proj"):
            p = module._parameters[pname]
            local = p.shape[0] // plan.ep_size
            shard = p.detach()[rank * local : (rank + 1) * local].clone()
            dt = DTensor.from_local(shard, plan.ep_mesh, [Shard(0)], run_check=False)
            module._parameters[pname] = nn.Parameter(dt, requires_grad=p.requires_grad)
        module._hasten_ep = _Dispatch(group, plan.ep_size, int(module.gate_up_proj.shape[0]))
        module.forward = types.MethodType(expert_parallel_forward, module)


#: the torch releases whose compiled expert dispatch trains wrongly (2.11: the second step's loss
#: differs from one process's by 7e-3 under ``aot_eager``; 2.13 and 2.15 agree within the tests' 1e-5)
COMPILE_BROKEN_BEFORE = (2, 12)


def check_compile(plan: ExpertParallelPlan, compiled: bool, version: str = torch.__version__) -> None:
    """Expert parallelism with ``torch.compile`` on a torch that compiles it wrongly: refused, by name."""
    found = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if compiled and found < COMPILE_BROKEN_BEFORE:
        raise ValueError(
            f"ParallelismConfig(ep_size={plan.ep_size}) with torch.compile (a TorchDynamoPlugin or "
            f"dynamo_backend) on torch {version}: its compiled expert dispatch trains with wrong gradients "
            f"(tested: the second step already differs from one process's); use torch >= "
            f"{COMPILE_BROKEN_BEFORE[0]}.{COMPILE_BROKEN_BEFORE[1]} or train the experts without compiling"
        )


def needs_fsdp(plan: ExpertParallelPlan, offload_policy: Any = None) -> bool:
    """Whether FSDP must manage the experts: it shards them over ``efsdp`` (or HSDP's
    ``(dp_replicate, efsdp)``) and reduces their gradients there. Where that mesh is one process
    (``ep_size == dp_shard_size``) it would only copy each expert in and out of a one-process
    all-gather and reduce-scatter every step, so the experts are left out of FSDP
    (:func:`leave_unsharded`), unless FSDP offloads the parameters to the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return plan.efsdp_mesh.size() > 1 or isinstance(offload_policy, CPUOffloadPolicy)


def leave_unsharded(module: nn.Module, mp_policy: Any = None) -> list[nn.Parameter]:
    """An experts module FSDP does not manage (:func:`needs_fsdp`): its forward casts the weights
    to the ``MixedPrecisionPolicy``'s ``param_dtype`` as FSDP's all-gather would, and its floating
    inputs where the policy casts forward inputs; returns its parameters, for ``fully_shard``'s
    ``ignored_params``."""
    dtype = getattr(mp_policy, "param_dtype", None)
    inputs = dtype if getattr(mp_policy, "cast_forward_inputs", False) else None
    module._hasten_ep = dataclasses.replace(module._hasten_ep, param_dtype=dtype, input_dtype=inputs)
    return list(module.parameters())


@dataclass(frozen=True)
class _Dispatch:
    group: Any
    ep_size: int
    num_experts: int
    #: where FSDP leaves the experts out, the dtypes its MixedPrecisionPolicy would have cast the
    #: weights and the floating inputs to (None: as they are)
    param_dtype: torch.dtype | None = None
    input_dtype: torch.dtype | None = None
    #: per (device type, dtype): whether the experts run as ``torch._grouped_mm`` (decided at the
    #: first forward, :func:`grouped_mm_works` and the weights' alignment), else a loop
    grouped: dict = field(default_factory=dict, compare=False)
    #: per device: each (source rank, local expert) block's place in expert-major order
    block_keys: dict = field(default_factory=dict, compare=False)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def keys(self, device: torch.device) -> torch.Tensor:
        keys = self.block_keys.get(device)
        if keys is None:
            block = torch.arange(self.num_experts, device=device)
            keys = self.block_keys[device] = (block % self.local_experts) * self.ep_size + block // self.local_experts
        return keys


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward, with the experts spread over the ep group (dropless)."""
    d: _Dispatch = self._hasten_ep
    if d.input_dtype is not None:  # FSDP's cast of the forward inputs, where FSDP leaves the experts out
        hidden_states, top_k_weights = hidden_states.to(d.input_dtype), top_k_weights.to(d.input_dtype)
    tokens, k = top_k_index.shape
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.zeros(d.num_experts, dtype=torch.long, device=pairs.device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))  # bincount, without its device sync
    received = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(received, counts, group=d.group)
    by_source = received.view(d.ep_size, d.local_experts)
    sent_and_received = torch.stack((counts.view(d.ep_size, d.local_experts).sum(1), by_source.sum(1)))
    send, recv = sent_and_received.tolist()  # the splits: the one sync with the host
    x = _AllToAll.apply(hidden_states[order // k], recv, send, d.group)
    # what arrived is ordered (source, expert): regroup by expert, run the experts, order back
    key = torch.repeat_interleave(d.keys(x.device), received, output_size=x.shape[0])
    regroup = torch.argsort(key, stable=True)
    y = run_local_experts(self, x[regroup], by_source.sum(0))
    y = y[torch.argsort(regroup)]
    back = _AllToAll.apply(y, send, recv, d.group)
    out = back[torch.argsort(order)].view(tokens, k, back.shape[-1]) * top_k_weights.unsqueeze(-1)  # 0 tokens too
    return out.sum(1).to(hidden_states.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_local_experts(module: nn.Module, x: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
    """Each local expert on its rows of ``x`` (rows grouped by expert, ``per_expert`` each, a
    tensor): one ``torch._grouped_mm`` per matrix where it runs (:func:`uses_grouped_mm`), else
    a loop over the experts."""
    d: _Dispatch = module._hasten_ep
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    if d.param_dtype is not None:  # FSDP's MixedPrecisionPolicy, where FSDP does not manage the experts
        gate_up, down = gate_up.to(d.param_dtype), down.to(d.param_dtype)
    scale = 1.0 / d.ep_size  # the gradients arrive summed over the ep group's data ranks
    gate_up, down = _ScaleGrad.apply(gate_up, scale), _ScaleGrad.apply(down, scale)
    gate = getattr(module, "_apply_gate", None) or (lambda h: _gate(module, h))
    if uses_grouped_mm(d, x, gate_up):
        ends = torch.cumsum(per_expert, 0, dtype=torch.int32)
        h = gate(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=ends))
        return torch._grouped_mm(h, down.transpose(-2, -1), offs=ends)
    outs, start = [], 0
    for e, n in enumerate(per_expert.tolist()):
        h = gate(nn.functional.linear(x[start : start + n], gate_up[e]))
        outs.append(nn.functional.linear(h, down[e]))
        start += n
    return torch.cat(outs) if outs else x


def uses_grouped_mm(d: _Dispatch, x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether the experts run as ``torch._grouped_mm`` for these inputs: decided once per
    (device type, dtype), the first time (:func:`grouped_mm_works`, and every row of the weights
    and activations 16-byte aligned, which it requires); never under autocast (it has no autocast
    rule: the loop's ``linear`` casts as autocast says), nor with inputs of another dtype, nor
    compiled in another dtype than bf16 (its meta kernel, what the compiler traces, takes bf16 only)."""
    if x.dtype != gate_up.dtype or torch.is_autocast_enabled(x.device.type):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    key = (x.device.type, x.dtype)
    ok = d.grouped.get(key)
    if ok is None:
        ok = d.grouped[key] = _aligned(gate_up.shape, x.element_size()) and grouped_mm_works(x.device, x.dtype)
    return ok


def _aligned(gate_up_shape: torch.Size, element_size: int) -> bool:
    """Rows of ``H``, ``I`` and ``2 I`` elements (``gate_up_proj [E, 2 I, H]``) are 16-byte multiples."""
    two_inner, hidden = gate_up_shape[-2], gate_up_shape[-1]
    return all(n * element_size % 16 == 0 for n in (hidden, two_inner // 2, two_inner))


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.disable
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` in ``dtype``, forward and backward, and
    agrees with a loop of matmuls there (tried once per device type and dtype, on tiny shapes
    with an empty group; a torch without it, or a kernel that refuses, is False)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_WORKS:
        _GROUPED_MM_WORKS[key] = _try_grouped_mm(device, dtype)
    return _GROUPED_MM_WORKS[key]


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    sizes = [9, 0, 15]  # three experts, one without rows
    x = torch.randn(24, 16, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(3, 32, 16, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(24, 32, generator=gen).to(device, dtype)
    try:
        with torch.autocast(device.type, enabled=False):
            ends = torch.tensor(sizes, device=device).cumsum(0, dtype=torch.int32)
            y = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
            gx, gw = torch.autograd.grad(y, (x, w), grad)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    xs, gs = x.detach().float().split(sizes), grad.float().split(sizes)
    ws = w.detach().float()
    ref = torch.cat([xe @ ws[e].T for e, xe in enumerate(xs)])
    ref_gx = torch.cat([ge @ ws[e] for e, ge in enumerate(gs)])
    ref_gw = torch.stack([ge.T @ xe for ge, xe in zip(gs, xs)])
    return all(
        torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2) for got, want in ((y, ref), (gx, ref_gx), (gw, ref_gw))
    )


def _gate(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    g, up = h.chunk(2, dim=-1)
    return module.act_fn(g) * up


# ---------------------------------------------------------------------------- the plan
def expert_parallel_plan(config: Any) -> ExpertParallelPlan:
    """The plan of a ``ParallelismConfig`` with ``ep_size > 1`` whose mesh is built."""
    handler, mesh = config.ep_handler, config.flattened["experts"]  # (dp_replicate, efsdp, ep)
    return ExpertParallelPlan(
        ep_mesh=mesh["ep"],
        efsdp_mesh=mesh["dp_replicate", "efsdp"] if config.dp_replicate_size > 1 else mesh["efsdp"],
        ep_size=config.ep_size,
        experts=tuple(handler.experts) if handler is not None and handler.experts else None,
    )
