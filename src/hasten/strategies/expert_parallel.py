"""Expert parallelism (EP): each MoE layer's experts split over the ``ep`` mesh dim, tokens sent to
their experts by an all-to-all and back (torchtitan's semantics, its ``AllToAllTokenDispatcher``).

``ep`` is carved out of the data-parallel sharding dim: ``dp_shard = efsdp x ep``
(``ParallelismConfig.ep_size``). The ranks of an ep group read different batches; each holds
``num_experts / ep_size`` experts of every MoE layer (the 3-D weights as DTensors ``Shard(0)`` on
``ep``), which FSDP2 then shards further over ``efsdp`` (``fsdp.apply_fsdp``); everything that is
not an expert is sharded over the whole data dims as without EP.

The experts module keeps its names and parameters; only its ``forward`` is replaced (on the
instance), so state dicts keep the model's own keys. The new forward takes what transformers'
experts take, ``(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``:

1. the (token, k) pairs are sorted by expert; the number each expert gets is sent to its owner
   first (an all-to-all of counts), then the tokens (an all-to-all with uneven splits);
2. the owner regroups what it received by local expert and runs each expert (a loop over the
   local experts: ``torch._grouped_mm`` is not used yet, its CUDA path has not been measured here,
   and on the CPU it refuses shapes whose rows are not 16-byte aligned);
3. the reverse all-to-all brings each result back, where it is weighted and summed over k.

Nothing is dropped, so the result is that of one process holding every expert. The gradient of
an expert arrives summed over its ep group's data ranks: it is scaled by ``1 / ep_size`` on its
way to the weights, and FSDP's mean over ``efsdp`` then makes it the mean over every data-parallel
rank, as the other parameters' gradients are (FSDP's own divide factor would need a reduce op
that gloo lacks).

Which modules are experts: those named by ``TorchExpertParallelConfig.experts`` (module-name
patterns, ``*`` for one name, or class names); else the model's own ``_ep_plan`` or its
``config.base_model_ep_plan`` (transformers' ``"ep_dispatch_experts"`` entries); else every module
holding 3-D ``gate_up_proj`` and ``down_proj`` parameters. An experts module must have
transformers' layout: ``gate_up_proj`` ``[E, 2 I, H]`` (gate then up), ``down_proj`` ``[E, H, I]``,
``act_fn``, no biases.
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Dispatch:
    group: Any
    ep_size: int
    num_experts: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


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
    tokens, k = top_k_index.shape
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(pairs, minlength=d.num_experts)
    received = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(received, counts, group=d.group)
    by_source = received.view(d.ep_size, d.local_experts)
    send = counts.view(d.ep_size, d.local_experts).sum(1).tolist()
    recv = by_source.sum(1).tolist()
    x = _AllToAll.apply(hidden_states[order // k], recv, send, d.group)
    # what arrived is ordered (source, expert): regroup by expert, run the experts, order back
    block = torch.repeat_interleave(torch.arange(by_source.numel(), device=x.device), by_source.reshape(-1))
    regroup = torch.argsort((block % d.local_experts) * d.ep_size + block // d.local_experts, stable=True)
    y = run_local_experts(self, x[regroup], by_source.sum(0).tolist())
    y = y[torch.argsort(regroup)]
    back = _AllToAll.apply(y, send, recv, d.group)
    out = back[torch.argsort(order)].view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return out.sum(1).to(hidden_states.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_local_experts(module: nn.Module, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
    """Each local expert on its rows of ``x`` (rows grouped by expert, ``per_expert`` each)."""
    scale = 1.0 / module._hasten_ep.ep_size  # the gradients arrive summed over the ep group's data ranks
    gate_up, down = (
        _ScaleGrad.apply(_local(module.gate_up_proj), scale),
        _ScaleGrad.apply(_local(module.down_proj), scale),
    )
    gate = getattr(module, "_apply_gate", None) or (lambda h: _gate(module, h))
    outs, start = [], 0
    for e, n in enumerate(per_expert):
        h = gate(nn.functional.linear(x[start : start + n], gate_up[e]))
        outs.append(nn.functional.linear(h, down[e]))
        start += n
    return torch.cat(outs) if outs else x


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
