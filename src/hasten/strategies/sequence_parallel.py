"""Ulysses sequence parallelism on FSDP2 (``ParallelismConfig(sp_size=N, sp_backend="torch")``).

The ``sp`` ranks of a data group read the same batch. Inside ``Accelerator.maybe_context_parallel``
(:func:`maybe_context_parallel` here) each keeps a contiguous slice of every sequence
(:func:`shard_sequences`); everything but attention is per token, so it runs on the slice as it
is. Attention needs the whole sequence: before it, q, k and v are exchanged head-for-sequence
(an all-to-all: each process then holds all the tokens of 1/N of the heads) and the output is
exchanged back after it (DeepSpeed-Ulysses, arXiv 2309.14509). Key/value heads are replicated
where ``sp_size`` does not divide them (GQA).

- transformers models: the model's entry of ``ALL_ATTENTION_FUNCTIONS`` (sdpa, flash attention)
  is wrapped once; the wrapper exchanges only for the attention modules of prepared models, and
  only inside ``maybe_context_parallel`` (a second model, or a forward outside it, keeps the plain
  function). A forward pre-hook fills the global ``position_ids`` of the slice, and the model's
  ``loss_function`` returns the whole sequences' token-weighted loss (see :func:`token_weighted_loss`).
- other models: call attention through :func:`sequence_parallel_attention` and reduce the loss
  with :func:`token_weighted_loss`; :func:`shard_positions` gives the slice's global positions.

The gradients: each process's loss carries ``sp_size`` times its slice's share of the whole
sequences' loss; FSDP averages gradients over ``dp_shard_cp`` (which holds the ``sp`` dim), so
the ``sp`` ranks' partial gradients add up to the whole sequences' gradient, as on one process.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from hasten.settings.parallelism import ParallelismConfig

__all__ = [
    "SequenceParallelPlan",
    "current_shard",
    "sequence_parallel_attention",
    "shard_positions",
    "shard_sequences",
    "token_weighted_loss",
]

#: transformers' attention implementations whose call can be wrapped (eager is called directly)
WRAPPABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
#: the layer types Ulysses runs (any other: linear attention, state-space, convolution layers)
FULL_LAYERS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class SequenceParallelPlan:
    """The parallelize pipeline's sequence-parallel step: the ``sp`` dim of the run's mesh."""

    mesh: Any
    #: the tensor-parallel size (each process's attention holds 1/tp of the heads)
    tp_size: int = 1


@dataclass
class Shard:
    """The sequence split in force inside ``maybe_context_parallel``."""

    group: Any
    rank: int
    size: int
    #: every process's positions on the whole sequences (batch x sequence), for flash attention's kwargs
    positions: torch.Tensor | None = field(default=None, repr=False)
    #: the length of each buffer's slice along its sequence dim (what attention must see)
    local: int | None = None
    #: whether attention was exchanged in this split (checked at a prepared model's first forward in one)
    exchanged: bool = False


_ACTIVE: list[Shard] = []
#: the modules of prepared models (their attention calls are exchanged)
_PREPARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def current_shard() -> Shard | None:
    """The split in force (inside ``maybe_context_parallel`` with ``sp_size > 1``), else None."""
    return _ACTIVE[-1] if _ACTIVE else None


# ---------------------------------------------------------------------------- the batch
def maybe_context_parallel(
    config: ParallelismConfig | None,
    mesh: DeviceMesh | None,
    buffers: list[Any] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[Any] | None,
) -> Any:
    """``Accelerator.maybe_context_parallel``: the sequences split over ``sp`` (Ulysses), over
    ``cp`` (torch's ``context_parallel``), or a context that does nothing."""
    from hasten.settings import parallelism as nd

    if config is None or mesh is None or not config.sp_enabled:
        return nd.context_parallel(config, mesh, buffers, buffer_seq_dims, no_restore_buffers)
    return shard_sequences(mesh["sp"], buffers, buffer_seq_dims, no_restore_buffers, run=mesh)


@contextlib.contextmanager
def shard_sequences(
    mesh: DeviceMesh,
    buffers: list[torch.Tensor] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    run: Any = None,
) -> Iterator[Shard]:
    """Each of ``buffers`` cut in place to this process's contiguous slice along its sequence dim
    (rank r of N keeps ``[r L/N, (r+1) L/N)``), and the attention of prepared models exchanged,
    inside the block; on exit the buffers not in ``no_restore_buffers`` hold their whole sequences again.
    The first split of a ``run`` (the Accelerator's whole mesh; by default ``mesh``) compares the
    ``sp`` ranks' buffers before cutting them (one all-gather, that once)."""
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims if buffer_seq_dims is not None else [])
    shard = Shard(mesh.get_group(), mesh.get_local_rank(), mesh.size())
    _check_entry(buffers, dims, shard)
    run = mesh if run is None else run
    if not getattr(run, "_hasten_sp_batches_checked", False):  # the first split: the batches compared, once
        _check_same_batches(buffers, shard)
        run._hasten_sp_batches_checked = True
    lengths = {b.shape[d] for b, d in zip(buffers, dims)}
    if len(lengths) > 1 or any(n % shard.size for n in lengths):
        raise ValueError(
            f"maybe_context_parallel with sp_size={shard.size}: the buffers' sequence lengths {sorted(lengths)} must "
            f"be one length divisible by sp_size (each process keeps 1/{shard.size}); pad the sequences to a multiple"
        )
    shard.local = lengths.pop() // shard.size
    kept = [_cut(b, d, shard) for b, d in zip(buffers, dims)]
    keep_out = {id(b) for b in (no_restore_buffers or ())}
    _ACTIVE.append(shard)
    try:
        yield shard
    finally:
        _ACTIVE.remove(shard)
        with torch.no_grad():
            for buffer, whole in zip(buffers, kept):
                if id(buffer) not in keep_out:
                    buffer.set_(whole)


def _check_entry(buffers: list[torch.Tensor], dims: list[int], shard: Shard) -> None:
    """What every process refuses alike before anything is cut: a split inside a split, no
    buffers, a sequence dim per buffer missing or out of range."""
    size = shard.size
    if _ACTIVE:
        raise ValueError(
            f"maybe_context_parallel (sp_size={size}) entered inside another maybe_context_parallel: its buffers "
            f"would be cut again, to 1/{size} of this process's slice, and attention would join the wrong tokens; "
            "enter it once per step, around the forward and backward, with every sequence buffer in one call"
        )
    if not buffers:
        raise ValueError(
            f"maybe_context_parallel with sp_size={size} got no buffers: nothing would be cut, so each process's "
            f"model would run on the whole sequences and its exchanged attention would join {size} copies of them "
            "into one sequence (silently wrong numbers). Pass the batch's sequence tensors, e.g. "
            "maybe_context_parallel(buffers=[input_ids, shift_labels], buffer_seq_dims=[1, 1])"
        )
    if len(buffers) != len(dims):
        raise ValueError(
            f"maybe_context_parallel got {len(buffers)} buffers and {len(dims)} buffer_seq_dims: "
            "give one sequence dim per buffer"
        )
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if not isinstance(b, torch.Tensor) or not -b.dim() <= d < b.dim():
            shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(
                f"maybe_context_parallel: buffer_seq_dims[{i}]={d} is not a dim of buffers[{i}] (shape {shape}); "
                "give each tensor's sequence dim (1 for batch x sequence)"
            )


def _check_same_batches(buffers: list[torch.Tensor], shard: Shard) -> None:
    """The ``sp`` ranks must hold the same whole sequences before the cut (the prepared DataLoader
    gives them the same batch); compared once (one all-gather), refused on every rank otherwise."""
    from hasten.strategies.tensor_parallel import differing_ranks

    differ = differing_ranks(buffers, shard.group)
    if differ:
        import torch.distributed as dist

        group = dist.get_process_group_ranks(shard.group)
        raise ValueError(
            f"sequence parallelism (sp_size={shard.size}): the processes of the sp group {group} got different "
            f"batches in maybe_context_parallel's buffers (rank(s) {differ} differ from rank {group[0]}): each keeps "
            "its slice of the same whole sequences, so every process of an sp group must hold the same batch, or "
            "training goes on silently wrong. Prepare the DataLoader with accelerator.prepare (it gives each sp "
            "group one batch), or hand-split the data over the data-parallel ranks only "
            "(accelerator.torch_device_mesh['dp'], not process_index); nothing was cut"
        )


def _cut(buffer: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    """``buffer`` cut in place to this process's slice; returns its whole self (a tensor on its old storage)."""
    whole = buffer.detach().view_as(buffer)
    local = buffer.shape[dim] // shard.size
    with torch.no_grad():
        buffer.set_(whole.narrow(dim, shard.rank * local, local).contiguous())
    return whole


def shard_positions(local_length: int, device: Any = None) -> torch.Tensor:
    """The global positions of this process's slice (``arange`` of the slice's place in the
    sequence); ``arange(local_length)`` outside a split."""
    shard = current_shard()
    start = shard.rank * local_length if shard is not None else 0
    return torch.arange(start, start + local_length, device=device)


# ---------------------------------------------------------------------------- attention
def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, shard: Shard) -> torch.Tensor:
    """Chunk j of ``x`` along ``scatter_dim`` goes to rank j; what arrives is joined along
    ``gather_dim`` in rank order (differentiable: backward is the reverse exchange)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    send = torch.stack(x.chunk(shard.size, dim=scatter_dim)).contiguous()
    received = all_to_all_single_autograd(send, None, None, shard.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def _replicate_kv(key: torch.Tensor, value: torch.Tensor, head_dim: int, size: int) -> tuple[Any, Any, int]:
    """Key/value heads repeated (each in place, GQA's order kept) until ``size`` divides them;
    returns them and the repeat factor."""
    heads = key.shape[head_dim]
    if heads % size == 0:
        return key, value, 1
    repeat = math.lcm(heads, size) // heads
    return key.repeat_interleave(repeat, dim=head_dim), value.repeat_interleave(repeat, dim=head_dim), repeat


def exchange_attention(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: Shard,
    head_dim: int = 1,
    seq_dim: int = 2,
    out_head_dim: int = 1,
    out_seq_dim: int = 2,
) -> tuple[torch.Tensor, int]:
    """``call(q, k, v)`` on all the tokens of 1/N of the heads: q, k, v exchanged head-for-sequence
    before it, its output sequence-for-head after it; returns the output and the key/value repeat factor."""
    heads = query.shape[head_dim]
    if shard.local is not None and query.shape[seq_dim] != shard.local:
        raise ValueError(
            f"sequence parallelism (sp_size={shard.size}): attention got {query.shape[seq_dim]} tokens per sequence "
            f"(query shape {tuple(query.shape)}, sequence dim {seq_dim}) where maybe_context_parallel cut the "
            f"sequences to {shard.local}: the model ran on tensors that were not cut (a model input missing from "
            "its buffers, or a wrong buffer_seq_dims), and exchanging them would join the wrong tokens. Pass every "
            "sequence input in buffers with its sequence dim (1 for batch x sequence)"
        )
    shard.exchanged = True
    if heads % shard.size:
        raise ValueError(
            f"sequence parallelism: sp_size={shard.size} must divide the attention heads of each process ({heads})"
        )
    key, value, repeat = _replicate_kv(key, value, head_dim, shard.size)
    q, k, v = (_all_to_all(t, head_dim, seq_dim, shard) for t in (query, key, value))
    return _all_to_all(call(q, k, v), out_seq_dim, out_head_dim, shard), repeat


def sequence_parallel_attention(
    attention: Callable[..., torch.Tensor],
    *,
    head_dim: int = 1,
    seq_dim: int = 2,
    out_head_dim: int | None = None,
    out_seq_dim: int | None = None,
) -> Callable[..., torch.Tensor]:
    """``attention(q, k, v, *args, **kwargs)`` (e.g. ``F.scaled_dot_product_attention``, layout
    batch x heads x sequence x dim) made sequence-parallel: inside ``maybe_context_parallel`` with
    ``sp_size > 1`` it sees every token of 1/N of the heads and returns this process's slice of the
    output (in the output's layout: ``out_head_dim``/``out_seq_dim``, by default the inputs'); elsewhere
    it is ``attention`` itself. Key/value heads that N does not divide are repeated (GQA: pass
    ``enable_gqa=True`` to sdpa)."""
    out_head = head_dim if out_head_dim is None else out_head_dim
    out_seq = seq_dim if out_seq_dim is None else out_seq_dim

    def sequence_parallel(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        shard = current_shard()
        if shard is None:
            return attention(query, key, value, *args, **kwargs)

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v, *args, **kwargs)

        return exchange_attention(call, query, key, value, shard, head_dim, seq_dim, out_head, out_seq)[0]

    sequence_parallel.__wrapped__ = attention  # type: ignore[attr-defined]
    return sequence_parallel


class _Groups:
    """An attention module as transformers' attention functions read it, with the query heads per
    key/value head after the key/value heads were repeated."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _transformers_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' attention function ``original(module, q, k, v, mask, **kwargs)`` (output
    batch x sequence x heads x dim) exchanged for the modules of prepared models inside a split."""

    def ulysses(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any):
        shard = current_shard()
        if shard is None or module not in _PREPARED:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None:
            raise ValueError(
                "sequence parallelism: the attention got a mask built for this process's slice of the sequence; "
                "pass no attention_mask (mark padding with -100 in shift_labels) and keep the model's causal attention"
            )
        if kwargs.get("position_ids") is not None and shard.positions is not None:
            kwargs["position_ids"] = shard.positions  # flash attention reads packed sequences from the whole

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            groups = q.shape[1] // k.shape[1]  # fewer than the module's where key/value heads were repeated
            same = getattr(module, "num_key_value_groups", groups) == groups
            return original(module if same else _Groups(module, groups), q, k, v, None, *args, **kwargs)[0]

        return exchange_attention(call, query, key, value, shard, 1, 2, 2, 1)[0], None

    ulysses.__wrapped__ = original  # type: ignore[attr-defined]
    ulysses._hasten_ulysses = True  # type: ignore[attr-defined]
    return ulysses


# ---------------------------------------------------------------------------- the loss
def _spread(loss: torch.Tensor, shard: Shard) -> torch.Tensor:
    """``loss`` (this process's part, which carries the gradient) with the value of the sum of
    every process's part divided by ``sp_size`` (each part is ``sp_size`` times its share)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total, group=shard.group)
    return loss + (total / shard.size - loss).detach()


def token_weighted_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> torch.Tensor:
    """The mean loss per token: ``loss_sum / num_tokens`` (this process's slice's summed loss and
    counted tokens). Inside a split it is the whole sequences' (the sums and counts of every
    process of the ``sp`` group), the same on each, and its gradient is this slice's part of the
    whole sequences' gradient, scaled for FSDP's average over the ``sp`` ranks."""
    shard = current_shard()
    if shard is None:
        return loss_sum / num_tokens
    import torch.distributed as dist

    count = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device).clone()
    dist.all_reduce(count, group=shard.group)
    return _spread(loss_sum * shard.size / count, shard)


class TokenWeightedLoss:
    """A transformers model's ``loss_function`` inside a split: ``num_items_in_batch`` (the
    tokens counted, given or over the whole sequences) makes it this slice's summed loss over them,
    times ``sp_size``; the value returned is the whole sequences' loss. Outside a split, the original."""

    def __init__(self, original: Callable[..., torch.Tensor]) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        shard = current_shard()
        if shard is None:
            return self.original(*args, **kwargs)
        labels = kwargs.get("shift_labels")
        if labels is None:
            raise ValueError(
                "sequence parallelism: the loss needs shift_labels (the labels shifted on the whole sequences, "
                "split like input_ids in maybe_context_parallel's buffers): each process holds a slice, so shifting "
                "labels there would lose the label at each slice's border"
            )
        count = kwargs.get("num_items_in_batch")
        if count is None:
            import torch.distributed as dist

            count = (labels != kwargs.get("ignore_index", -100)).sum().to(torch.float32)
            dist.all_reduce(count, group=shard.group)
        kwargs["num_items_in_batch"] = count / shard.size
        return _spread(self.original(*args, **kwargs), shard)


# ---------------------------------------------------------------------------- the pipeline step
def _attn_config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None


def check_model(module: nn.Module, plan: SequenceParallelPlan | None) -> None:
    """What Ulysses cannot run on a transformers model, refused naming why (before anything changes):
    an attention implementation it cannot wrap, heads that ``sp_size`` does not share out, layers
    other than attention, sliding windows under sdpa. Other models wrap their own attention."""
    config = _attn_config(module) if plan is not None else None
    if config is None:
        return
    size, name = plan.mesh.size(), type(module).__name__
    impl = config._attn_implementation
    if impl not in WRAPPABLE:
        raise ValueError(
            f"ParallelismConfig(sp_size={size}): {name} uses attn_implementation={impl!r}, which sequence "
            f"parallelism cannot wrap (transformers calls it directly); load the model with one of "
            f"{', '.join(map(repr, WRAPPABLE))} (e.g. attn_implementation='sdpa')"
        )
    others = sorted({t for t in getattr(config, "layer_types", None) or () if t not in FULL_LAYERS})
    if others:
        raise ValueError(
            f"ParallelismConfig(sp_size={size}): {name} has {', '.join(others)} layers; sequence parallelism "
            "exchanges attention heads only, so layers that carry a state along the sequence (linear attention, "
            "state-space, convolution) would see a slice of it. Use sp_size=1 for this model"
        )
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )
    if sliding and impl == "sdpa":
        raise ValueError(
            f"ParallelismConfig(sp_size={size}): {name} has sliding-window attention, whose sdpa mask would be built "
            "for one process's slice of the sequence; use attn_implementation='flash_attention_2' (the window is "
            "applied inside the kernel) or sp_size=1"
        )
    _check_heads(config, size, plan.tp_size, name)


def _check_heads(config: Any, size: int, tp: int, name: str) -> None:
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    local, local_kv = heads // tp, max(kv // tp, 1)
    if local % size or local % math.lcm(local_kv, size):
        raise ValueError(
            f"ParallelismConfig(sp_size={size}): {name} has {heads} attention heads ({kv} key/value heads)"
            f"{f' over tp_size={tp}' if tp > 1 else ''}; sp_size must divide each process's {local} heads, and "
            f"the key/value heads repeated up to a multiple of sp_size ({math.lcm(local_kv, size)}) must divide them "
            f"too. Choose sp_size among {[d for d in range(2, local + 1) if local % math.lcm(local_kv, d) == 0]}"
        )


def apply_sequence_parallel(module: nn.Module, plan: SequenceParallelPlan | None, whole: bool = False) -> None:
    """The model's attention calls exchanged inside ``maybe_context_parallel``; for a transformers
    model also its attention function wrapped (once per process), its global positions filled in
    and its loss made the whole sequences' token-weighted loss. A ``whole`` model (not a pipeline
    stage) must exchange attention in its first forward inside a split (:func:`require_exchange`)."""
    if plan is None:
        return
    _PREPARED.update(module.modules())
    if whole:
        require_exchange(module)
    config = _attn_config(module)
    if config is None:
        return
    from transformers.modeling_utils import AttentionInterface

    impl = config._attn_implementation
    current = AttentionInterface._global_mapping[impl]
    if not getattr(current, "_hasten_ulysses", False):
        AttentionInterface.register(impl, _transformers_attention(current))
    module.register_forward_pre_hook(_fill_inputs, with_kwargs=True, prepend=True)
    if hasattr(module, "loss_function") and not isinstance(module.loss_function, TokenWeightedLoss):
        module.loss_function = TokenWeightedLoss(module.loss_function)


def require_exchange(module: nn.Module) -> None:
    """The first forward of ``module`` inside a split must exchange attention (its attention called
    through :func:`sequence_parallel_attention`, or transformers' wrapped function): otherwise each
    process's attention saw only its slice of each sequence, silently. Refused after that forward on
    every process alike (no collective: the model's code decides); once it exchanged, the hook goes."""
    handle: list[Any] = []
    name = type(module).__name__  # before FSDP renames the class

    @torch.compiler.disable
    def after(mod: nn.Module, args: Any, output: Any) -> None:
        shard = current_shard()
        if shard is None:  # outside a split: the whole sequences, plain attention
            return
        if not shard.exchanged:
            raise ValueError(
                f"sequence parallelism (sp_size={shard.size}): the forward of {name} inside "
                "maybe_context_parallel exchanged no attention, so each process's attention saw only its slice of "
                "each sequence (silently wrong numbers). Call attention through "
                "hasten.strategies.sequence_parallel.sequence_parallel_attention(F.scaled_dot_product_attention) "
                "(a transformers model: attn_implementation 'sdpa' or a flash attention), or use sp_size=1 for a "
                "model without attention"
            )
        for h in handle:
            h.remove()
        handle.clear()

    handle.append(module.register_forward_hook(after))


def _check_length(tokens: torch.Tensor, shard: Shard) -> None:
    if shard.local is not None and tokens.shape[1] != shard.local:
        raise ValueError(
            f"sequence parallelism (sp_size={shard.size}): the model got {tokens.shape[1]} tokens per sequence "
            f"(shape {tuple(tokens.shape)}) where maybe_context_parallel cut the sequences to {shard.local}: pass "
            "the model's inputs in buffers with their sequence dim (1 for batch x sequence), and run the model on them"
        )


def _drop_full_mask(mask: torch.Tensor, shard: Shard, whole_length: int) -> None:
    """A 2-D ``attention_mask`` inside a split: dropped where it is all ones on every process of
    the sp group, else refused on every process alike. A mask cut with the buffers is agreed
    over the group (one all-reduce of one number per forward: pass no mask to save it)."""
    ones = torch.tensor(int(bool(mask.all())), device=mask.device)
    if mask.shape[1] != whole_length:  # cut with the buffers: this process holds its slice only
        import torch.distributed as dist

        dist.all_reduce(ones, op=dist.ReduceOp.MIN, group=shard.group)
    if not bool(ones):
        raise ValueError(
            f"sequence parallelism (sp_size={shard.size}): the attention_mask marks padding, and a mask cannot "
            "follow each process's slice through the exchanged attention; pass no attention_mask (mark padding "
            "with -100 in shift_labels) and keep the model's causal attention"
        )


def _fill_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A transformers model's forward inside a split: the slice's global ``position_ids`` where
    none are given, ``labels`` from ``shift_labels`` (transformers computes the loss when labels
    are given and reads only shift_labels then), an all-ones ``attention_mask`` dropped (a padding
    one refused on every process: :func:`_drop_full_mask`), inputs longer than the cut refused."""
    shard = current_shard()
    if shard is None:
        return None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        return None
    _check_length(tokens, shard)
    batch, local = tokens.shape[0], tokens.shape[1]
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        _drop_full_mask(mask, shard, local * shard.size)
        kwargs["attention_mask"] = None
    given = kwargs.get("position_ids")
    if given is None:
        kwargs["position_ids"] = shard_positions(local, tokens.device).unsqueeze(0).expand(batch, -1)
        shard.positions = torch.arange(local * shard.size, device=tokens.device).unsqueeze(0).expand(batch, -1)
    else:
        shard.positions = _gather_sequence(given, shard)
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "sequence parallelism: pass shift_labels (the labels shifted on the whole sequences, in "
            "maybe_context_parallel's buffers) rather than labels alone: each process holds a slice, so shifting "
            "labels there would lose the label at each slice's border"
        )
    if kwargs.get("labels") is None and kwargs.get("shift_labels") is not None:
        kwargs["labels"] = kwargs["shift_labels"]
    return args, kwargs


def _gather_sequence(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Every process's slice of ``tensor`` (batch x slice), joined along the sequence (no gradient)."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(shard.size)]
    dist.all_gather(parts, tensor.contiguous(), group=shard.group)
    return torch.cat(parts, dim=1)
