"""Tensor parallelism on the mesh's ``tp`` dim: torch's ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``, the only place they are used.

A plan maps module-name patterns (``*`` stands for one name, e.g. a layer number) to a
style: ``"colwise"`` (the output features split, the input replicated), ``"rowwise"`` (the
input features split, the output summed), and transformers' ``"colwise_rep"`` /
``"colwise_gather_output"`` (a replicated output), ``"rowwise_rep"`` (a replicated input) and
``"embedding_rowwise"`` (an embedding's vocabulary split), and ``"replicated_with_grad_allreduce"``
for a module with parameters of its own that runs on activations TP split (Qwen3's ``q_norm``
over each process's heads): its parameters stay whole on every process and their gradients are
summed over ``tp`` in backward (each process's is its heads' part). A replicated parameter whose
gradients still differ over ``tp`` at the first optimizer step (a hand-written plan that split
the heads and not its norm) is refused there, by name (:func:`replicated_grad_check`): its
gradient would be a part of the whole, silently. The plan comes from
``ParallelismConfig.tp_plan``, else the model's own ``_tp_plan``, else its config's
``base_model_tp_plan`` (keys below ``base_model_prefix``). The parallelize pipeline applies it
(``parallelize.apply_tp``) on the meta device, before activation checkpointing, compilation and
``fully_shard`` (torchtitan's order); a model whose parameters already are DTensors on the ``tp``
dim is adopted as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from hasten.settings.parallelism import check_tp_plan


def model_plan(model: torch.nn.Module, given: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """The plan to apply and where it came from (named in errors)."""
    if given is not None:
        return given, "ParallelismConfig.tp_plan"
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return check_tp_plan(dict(own), f"{type(model).__name__}._tp_plan"), f"{type(model).__name__}._tp_plan"
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        names = dict(model.named_modules())
        if prefix and prefix in names:
            base = {f"{prefix}.{k}": s for k, s in base.items()}
        where = f"{type(model).__name__}.config.base_model_tp_plan"
        return check_tp_plan(base, where), where
    raise ValueError(
        f"ParallelismConfig(tp_size>1) needs a tensor-parallel plan, and {type(model).__name__} has none: pass "
        "ParallelismConfig(tp_plan={'layers.*.attn.q': 'colwise', 'layers.*.attn.o': 'rowwise', ...}) "
        "(module-name patterns to 'colwise'/'rowwise'), or a model that carries _tp_plan / config.base_model_tp_plan"
    )


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def resolve(model: torch.nn.Module, plan: dict[str, str], where: str) -> dict[str, str]:
    """The plan on the model's module names; a pattern that names no module, or a style on a
    module that is not a Linear (or Embedding), is refused, naming it."""
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for key, style in plan.items():
        matched = [n for n in names if _pattern(key).match(n)]
        if not matched:
            close = sorted(names, key=len)[:8]
            raise ValueError(
                f"{where}[{key!r}] names no module of {type(model).__name__}; its modules are named like: "
                f"{', '.join(close)}{' ...' if len(names) > 8 else ''}"
            )
        for name in matched:
            kind = type(modules[name])
            if style == SUMMED:
                if not any(True for _ in modules[name].parameters()):
                    raise ValueError(
                        f"{where}[{key!r}] = {style!r} matches {name!r}, a {kind.__name__} without parameters: the "
                        "style sums its parameters' gradients over tp"
                    )
            elif not issubclass(kind, (torch.nn.Linear, torch.nn.Embedding)):
                raise ValueError(
                    f"{where}[{key!r}] = {style!r} matches {name!r}, a {kind.__name__}: tensor parallel styles apply "
                    "to nn.Linear (and nn.Embedding) modules only"
                )
            resolved[name] = style
    return resolved


#: the style whose module keeps its parameters whole and sums their gradients over ``tp``
SUMMED = "replicated_with_grad_allreduce"


def _style(name: str, float8: bool = False) -> Any:
    """The torch style of a plan's style name; torchao's float8 styles for a layer fp8 converted
    (its input is cast to fp8 before TP's communication, and the matmul runs on the local shard)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = ColwiseParallel, RowwiseParallel
    if float8:
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        colwise, rowwise = Float8ColwiseParallel, Float8RowwiseParallel
    return {
        "colwise": lambda: colwise(),
        "rowwise": lambda: rowwise(),
        "colwise_rep": lambda: colwise(output_layouts=Replicate()),
        "colwise_gather_output": lambda: colwise(output_layouts=Replicate()),
        "rowwise_rep": lambda: rowwise(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocab split, the lookup summed
    }[name]()


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Whether the model was parallelised already (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_adopted(model: torch.nn.Module, tp_mesh: Any) -> None:
    """A model the user parallelised must be on this Accelerator's ``tp`` mesh (FSDP then
    composes on the data dims)."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.device_mesh != tp_mesh:
            raise ValueError(
                f"prepare() got a model whose parameter {name} is a DTensor on {p.device_mesh}, not on this "
                "Accelerator's tensor-parallel mesh: parallelise it on accelerator.torch_device_mesh['tp'] "
                "(or leave it plain and give ParallelismConfig a tp_plan)"
            )


def apply_plan(model: torch.nn.Module, tp_mesh: Any, resolved: dict[str, str]) -> None:
    """Parallelise ``model`` in place on ``tp_mesh`` with a plan from ``resolve`` (its
    parameters become DTensors; on the meta device nothing is communicated)."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(model.named_modules())
    styles = {name: _style(style, _is_float8(modules.get(name))) for name, style in resolved.items() if style != SUMMED}
    if styles:
        parallelize_module(model, tp_mesh, styles)
    for name, style in resolved.items():
        if style == SUMMED:
            sum_grads_over(modules[name], tp_mesh.get_group())


class _SumGrad(torch.autograd.Function):
    """The identity forward; backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(grad.contiguous(), "sum", ctx.group), None


def sum_grads_over(module: torch.nn.Module, group: Any) -> None:
    """``module``'s own parameters reach its forward through :class:`_SumGrad`: their gradients
    are summed over ``group`` in backward (before FSDP reduces them over the data dims), however the
    backward is started. The parameters themselves, and the state dict, are unchanged."""
    forward = module.forward
    names = [n for n, _ in module.named_parameters(recurse=False)]

    def summed_forward(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        kept = {n: params[n] for n in names}
        for n, p in kept.items():  # the tensors of this call (FSDP's unsharded ones inside its forward)
            if p is not None and p.requires_grad and torch.is_grad_enabled():
                params[n] = _SumGrad.apply(p, group)
        try:
            return forward(*args, **kwargs)
        finally:
            params.update(kept)

    module.forward = summed_forward


def replicated_grad_check(model: torch.nn.Module, tp_mesh: Any) -> Callable[..., None]:
    """An optimizer pre-step hook for the first step: every parameter kept whole on the ``tp``
    ranks must have the same gradient on each (the whole one: their activations are whole, or the
    style summed it). One that differs is a part of the whole gradient (it ran on this process's
    share of heads or features): refused before anything steps, naming it and the style to give it
    (and again at every later step: the hook stays). One collective; once passed, the hook removes
    itself."""
    handle: list[Any] = []

    def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        import torch.distributed as dist

        computed = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        if not computed:  # a step before any backward: checked at the next one
            return None
        whole = [(n, p) for n, p in computed if not _on_tp(p)]
        if not whole:
            return _passed()
        sums = torch.stack([_checksum(p.grad) for _, p in whole])
        gathered = [torch.empty_like(sums) for _ in range(tp_mesh.size())]
        dist.all_gather(gathered, sums, group=tp_mesh.get_group())
        every = torch.stack(gathered)  # tp ranks x parameters x 2
        spread = (every.amax(0) - every.amin(0)).amax(-1)
        scale = every.abs().amax(0).amax(-1)
        parts = [n for (n, _), d, m in zip(whole, spread.tolist(), scale.tolist()) if d > 1e-6 * m + 1e-12]
        if parts:
            shown = ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")
            patterns = sorted({_as_pattern(n.rpartition(".")[0]) for n in parts})[:4]
            raise ValueError(
                f"tensor parallelism (tp_size={tp_mesh.size()}): the gradients of {shown} differ between the tp "
                "ranks, so each holds only its part of the whole gradient (the module runs on the heads or features "
                "this rank's TP layers split off, e.g. a per-head norm) and training would go on silently wrong. "
                "Give the module the style 'replicated_with_grad_allreduce' in tp_plan ({"
                + ", ".join(f"{p!r}: 'replicated_with_grad_allreduce'" for p in patterns)
                + "}), which sums its gradients over tp; nothing has stepped"
            )
        return _passed()

    def _passed() -> None:
        for h in handle:
            h.remove()
        handle.clear()

    def install(optimizer: torch.optim.Optimizer) -> None:
        handle.append(optimizer.register_step_pre_hook(check))

    check.install = install  # type: ignore[attr-defined]
    return check


def differing_ranks(tensors: list[torch.Tensor], group: Any) -> list[int]:
    """The ranks of ``group`` (global numbers) whose ``tensors`` differ from its first rank's, in
    their number, shapes or values (a position-weighted checksum of each, in float64): one
    all-gather of a few numbers per tensor's summary. Every rank gets the same answer."""
    import torch.distributed as dist

    mine = _fingerprint(tensors, _group_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    first, ranks = every[0], dist.get_process_group_ranks(group)
    scale = first.abs().amax() + 1.0
    return [r for r, f in zip(ranks, every) if bool(((f - first).abs() > 1e-12 * scale).any())]


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many tensors, their elements, their shapes' hash, their sum and their position-weighted sum."""
    count = float(len(tensors))
    numel = shapes = total = weighted = torch.zeros((), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        x = (t._local_tensor if hasattr(t, "_local_tensor") else t).detach()
        x = torch.view_as_real(x) if x.is_complex() else x
        x = torch.nan_to_num(x.reshape(-1).to(device, torch.float64))
        w = torch.arange(x.numel(), device=device, dtype=torch.float64) % 9973 + 1
        numel = numel + x.numel()
        shapes = shapes + (hash((i, tuple(t.shape))) % 2**40)
        total, weighted = total + x.sum(), weighted + (x * w).sum()
    return torch.stack([torch.tensor(count, dtype=torch.float64, device=device), numel, shapes, total, weighted])


def _group_device(group: Any) -> torch.device:
    """Where ``group``'s collectives take tensors: the CPU where gloo runs them, else the accelerator."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)) or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def check_same_inputs(model: torch.nn.Module, tp_mesh: Any) -> None:
    """The processes of a ``tp`` group must run each forward on the same inputs (TP splits the
    weights, not the batch): a forward pre-hook compares the model's input tensors over the group
    at the first forward (one all-gather), and refuses on every rank, naming the group and how to
    feed it, when they differ; once they agree, the hook removes itself. Inputs that differ (a
    DDP-style hand split of the batch) otherwise train silently wrong."""
    from torch.utils._pytree import tree_leaves

    handle: list[Any] = []
    name = type(model).__name__  # before FSDP renames the class

    @torch.compiler.disable
    def check(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        differ = differing_ranks(tensors, tp_mesh.get_group())
        if differ:
            import torch.distributed as dist

            group = dist.get_process_group_ranks(tp_mesh.get_group())
            raise ValueError(
                f"tensor parallelism (tp_size={tp_mesh.size()}): the processes of the tp group {group} got different "
                f"inputs at the first forward of {name} (rank(s) {differ} differ from rank "
                f"{group[0]}): TP splits the weights, not the batch, so every process of a tp group must run on the "
                "same batch, or training goes on silently wrong. Prepare the DataLoader with accelerator.prepare (it "
                "gives each tp group one batch), or hand-split the data over the data-parallel ranks only "
                "(accelerator.torch_device_mesh['dp'], not process_index); nothing has run"
            )
        for h in handle:
            h.remove()
        handle.clear()

    handle.append(model.register_forward_pre_hook(check, with_kwargs=True, prepend=True))


def _on_tp(p: torch.Tensor) -> bool:
    """Whether ``p`` is split over the ``tp`` dim (a DTensor with a non-replicated placement there)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and not isinstance(p.placements[names.index("tp")], Replicate)


def _checksum(grad: torch.Tensor) -> torch.Tensor:
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    local = local.detach().double()
    return torch.stack([local.sum(), local.abs().sum()])


def _as_pattern(name: str) -> str:
    """A module name with its layer numbers as ``*`` (``model.layers.3.self_attn.q_norm`` ->
    ``model.layers.*.self_attn.q_norm``)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _is_float8(module: torch.nn.Module | None) -> bool:
    return type(module).__name__ == "Float8Linear"


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, pp_group: Any = None) -> torch.Tensor:
    """Clip by the norm over every gradient of ``parameters`` on the whole mesh, whatever
    sub-meshes their DTensors live on (FSDP-only parameters on the data dims, tensor-parallel
    ones on data x tp): each mesh's part is reduced by DTensor (``full_tensor``), then the
    parts are combined, and with ``pp_group`` (pipeline stages) combined over it too. Returns a
    plain tensor, the same on every process."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    parts = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not parts and pp_group is None:
        return torch.tensor(0.0)
    device = parts[0].device if parts else _grad_device(params)
    stacked = torch.stack([p.to(device) for p in parts]) if parts else torch.zeros(1, device=device)
    total = stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)
    if pp_group is not None:
        total = _combine_stages(total.float(), norm_type, pp_group)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _grad_device(params: list[torch.Tensor]) -> torch.device:
    import torch.distributed as dist

    if params:
        return params[0].grad.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _combine_stages(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm over every pipeline stage from each stage's ``norm`` (its p-th powers summed;
    the largest for the inf-norm)."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)
