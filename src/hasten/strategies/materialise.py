"""Sharding where the model was built: what the FSDP2 strategy does between "a module" and
"a sharded module holding the right numbers", so that no process ever holds the whole model
after ``prepare`` and only shards reach the device.

The steps, in torchtitan's order (the parallelize pipeline calls them: ``move_to_meta`` steps 1
and 2, ``apply_materialise`` steps 3 and 4; with one process ``apply_placement`` allocates and
fills a model built on the meta device):

1. ``survey``: what each process has (real weights, or the meta device), agreed over the group
   in one collective, which decides where the numbers come from:

   - ``"local"``: every process built the same real weights (same seed): each copies its own
     slices from its own copy, no communication;
   - ``"broadcast"``: the main process has real weights and the others differ or are on meta
     (``cpu_ram_efficient_loading``): tensor by tensor, the main process's values are
     broadcast and each process keeps its slices (what DDP does at construction);
   - ``"init"``: every process is on meta: each module's ``reset_parameters`` (or the plugin's
     ``param_init_fn``) runs as it would on the unsharded model, one module at a time on the
     CPU, and each process keeps its slices; what no initialiser covers stays *unfilled*.

2. ``to_meta``: the real parameters move to the meta device in place (``swap_tensors``, so the
   ``Parameter`` objects the user's optimizer and tied modules hold stay the same objects);
   their values are kept aside only for as long as step 4 needs them.
3. ``fully_shard`` on meta (``fsdp.apply_fsdp``), then ``materialise``: only this process's shards are
   allocated (on the CPU with ``cpu_offload``, else on the mesh's device); buffers and
   parameters FSDP leaves whole (``ignored_modules``) go to the device.
4. ``fill_local`` / ``fill_broadcast`` / ``initialise``.

A model with unfilled tensors refuses its first forward and any save, naming them
(``require_filled``); loading a checkpoint (``mark_filled``) fills them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

#: the attribute of a prepared module that lists what nothing has filled yet
UNFILLED = "_hasten_unfilled"
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


# ---------------------------------------------------------------------------- naming
def tensor_names(module: nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Every name of every parameter and buffer -> the first name of that tensor (tied weights
    share one), and the first names -> the tensors."""
    alias: dict[str, str] = {}
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    items = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, t in items:
        name = name.replace(_CHECKPOINT_WRAPPER, "")  # state-dict keys leave activation checkpointing's wrapper out
        canonical = first.setdefault(id(t), name)
        alias[name] = canonical
        tensors.setdefault(canonical, t)
    return alias, tensors


def local_slices(t: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the full tensor that this process's shard of DTensor ``t`` holds (None: a
    plain tensor, all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor to write this process's values into (a DTensor's local shard, else ``t``)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def copy_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this process's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    part = local_slices(target)
    source = full[part] if part is not None else full
    with torch.no_grad():
        local_of(target).copy_(source.reshape(local_of(target).shape))


# ---------------------------------------------------------------------------- 1. survey
def fingerprint(tensors: dict[str, torch.Tensor]) -> tuple[float, ...]:
    """Two float64 sums per tensor: equal on two processes when their weights are the same."""
    out: list[float] = []
    for t in tensors.values():
        t = t.detach()
        if t.is_floating_point() or t.is_complex():
            out += [torch.sum(t, dtype=torch.float64).item(), torch.linalg.vector_norm(t, dtype=torch.float64).item()]
        else:
            out += [float(torch.sum(t, dtype=torch.int64).item()), float(t.numel())]
    return tuple(out)


class Survey(NamedTuple):
    #: "local" | "broadcast" | "init" (see the module's docstring)
    source: str
    #: the main process's CPU RNG state for "init" when the processes' states differ, else None
    rng_state: torch.Tensor | None
    #: first names of the buffers that were on the meta device where the values come from
    meta_buffers: set[str]
    #: first names of the parameters
    params: set[str]


def survey(module: nn.Module, group_size: int) -> Survey:
    """Where the numbers of ``module`` come from on every process, agreed in one collective.

    Parameters decide: all real or all on meta on each process (a process other than the main
    one may hold some on meta when the main one holds all: it receives them). Buffers may stay
    real on a meta model (Accelerate's ``init_empty_weights`` keeps them): those are kept as they are.
    """
    import torch.distributed as dist

    _, tensors = tensor_names(module)
    params = {n for n, t in tensors.items() if isinstance(t, nn.Parameter)}
    on_meta = [tensors[n].is_meta for n in params]
    real, partly = not any(on_meta), any(on_meta) and not all(on_meta)
    meta_buffers = sorted(n for n, t in tensors.items() if n not in params and t.is_meta)
    solid = {n: t for n, t in tensors.items() if not t.is_meta}
    mine = (
        real,
        partly,
        fingerprint(solid) if real and group_size > 1 else None,
        torch.get_rng_state().numpy().tobytes(),
        meta_buffers,
    )
    everyone = [mine]
    if group_size > 1:
        everyone = [None] * group_size
        dist.all_gather_object(everyone, mine)
    # Partly on meta is fine where the main process has every weight and sends them (transformers 5
    # under cpu_ram_efficient_loading leaves what the file lacks on meta on the other processes).
    main_real = everyone[0][0]
    where = [i for i, e in enumerate(everyone) if e[1] and (i == 0 or not main_real)]
    if where:
        raise ValueError(
            f"prepare() got a model with some parameters on the meta device and some real (process {where[0]}): "
            "build it whole on the meta device (then load or initialise it) or whole for real"
        )
    main = everyone[0]
    if all(e[0] for e in everyone) and all(e[2] == main[2] and e[4] == main[4] for e in everyone):
        return Survey("local", None, set(meta_buffers), params)
    if main[0]:
        return Survey("broadcast", None, set(main[4]), params)
    if any(e[0] for e in everyone):
        first = next(i for i, e in enumerate(everyone) if e[0])
        raise ValueError(
            f"prepare() got a model on the meta device on the main process but with real weights on process {first}: "
            "the main process is the one whose weights every process receives; build the model for real there "
            "(cpu_ram_efficient_loading), or on the meta device everywhere (then load or initialise it)"
        )
    same_rng = all(e[3] == main[3] for e in everyone)
    rng = None if same_rng else torch.frombuffer(bytearray(main[3]), dtype=torch.uint8)
    return Survey("init", rng, set(meta_buffers), params)


def fill(
    module: nn.Module,
    found: Survey,
    values: dict[str, torch.Tensor],
    device: torch.device,
    is_main: bool,
    init_fn: Callable[[nn.Module], Any] | None,
    whole: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Step 4: the numbers, from where ``found`` says; what nothing fills is marked unfilled.
    ``whole``: the whole model's tensor table where ``module`` is one pipeline stage's part."""
    if found.source == "local":
        fill_local(module, values)
        unfilled = found.meta_buffers
    elif found.source == "broadcast":
        fill_broadcast(module, values, device, is_main, whole)
        unfilled = found.meta_buffers  # the main process had no values for these either
    else:
        unfilled = (found.params | found.meta_buffers) - initialise(module, init_fn, found.rng_state)
    mark_unfilled(module, unfilled)


# ---------------------------------------------------------------------------- 2. to meta
def to_meta(module: nn.Module, keep: Callable[[nn.Parameter], bool]) -> dict[str, torch.Tensor]:
    """Move every real parameter of ``module`` for which ``keep`` is False to the meta device,
    in place (the same ``Parameter`` objects); returns their values by first name."""
    alias, tensors = tensor_names(module)
    values: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if isinstance(t, nn.Parameter) and not t.is_meta and not keep(t):
            empty = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
            torch.utils.swap_tensors(t, empty)  # t is now meta; `empty` holds the values
            values[name] = empty.detach()
    return values


# ---------------------------------------------------------------------------- 3. materialise
def materialise(module: nn.Module, param_device: torch.device, device: torch.device) -> None:
    """Allocate what is on the meta device: sharded parameters on ``param_device``, the rest
    (buffers, unsharded parameters) on ``device``; real plain tensors move to ``device``. Every
    ``Parameter`` stays the same object (ties, the optimizer's references)."""
    from torch.distributed.tensor import DTensor

    materialise_plain(module, device)

    def place(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return torch.empty_like(t, device=param_device) if t.is_meta else t
        return t.to(device)

    module._apply(place)  # FSDP's _apply re-points its shards at the new local tensors


def materialise_plain(module: nn.Module, device: torch.device) -> None:
    """Allocate the plain (not sharded) meta tensors of ``module`` on ``device``, keeping the
    ``Parameter`` objects (``nn.Module._apply`` would make new ones: ties and the optimizer's
    references would point at the old ones)."""
    from torch.distributed.tensor import DTensor

    _, tensors = tensor_names(module)
    for t in tensors.values():
        if isinstance(t, nn.Parameter) and t.is_meta and not isinstance(t, DTensor):
            torch.utils.swap_tensors(t, nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad))
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)


# ---------------------------------------------------------------------------- 4. fill
def fill_local(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Each process copies its slices from its own full values (those of tensors it holds: a
    pipeline stage's process holds part of the model)."""
    _, tensors = tensor_names(module)
    for name, full in values.items():
        if name in tensors:
            copy_part(tensors[name], full)


def fill_broadcast(
    module: nn.Module,
    values: dict[str, torch.Tensor],
    device: torch.device,
    is_main: bool,
    whole: dict[str, dict[str, Any]] | None = None,
) -> None:
    """The main process's values, one tensor at a time (through ``device``, as the backend
    needs), each process keeping its slices; the buffers too, persistent or not. ``whole``: the
    whole model's table (name -> shape, dtype) where each process holds a pipeline stage: every
    process takes part in every broadcast, in the whole model's order, keeping what it holds."""
    import torch.distributed as dist

    _, tensors = tensor_names(module)
    order = whole if whole is not None else {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in tensors.items()}
    for name, facts in order.items():
        t = tensors.get(name)
        if is_main:
            full = values[name] if name in values else t.detach()
            full = full.to(device)
        else:
            dtype = facts["dtype"] if isinstance(facts["dtype"], torch.dtype) else getattr(torch, facts["dtype"])
            full = torch.empty(facts["shape"], dtype=dtype, device=device)
        dist.broadcast(full, src=0)
        if t is None or (is_main and name not in values):
            continue  # another stage's, or the main process's own buffer, already in place
        copy_part(t, full)
        del full


def _own(module: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for store in (module._parameters, module._buffers):
        for name, t in store.items():
            if t is not None:
                yield store, name, t


def _reset_of(module: nn.Module) -> Callable[[], Any] | None:
    """The method that draws ``module``'s own initial values: ``reset_parameters``, else
    ``nn.MultiheadAttention``'s ``_reset_parameters`` (torch's name there)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    return module._reset_parameters if isinstance(module, nn.MultiheadAttention) else None


def _init_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every module (duplicates too) in the order construction initialises them: parents first,
    in registration order, except ``nn.MultiheadAttention``, whose ``__init__`` calls its
    ``_reset_parameters`` after building its output projection (which it then zeroes the bias of)."""
    last = isinstance(module, nn.MultiheadAttention)
    if not last:
        yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _init_order(child, f"{prefix}.{name}" if prefix else name)
    if last:
        yield prefix, module


def initialise(
    module: nn.Module, init_fn: Callable[[nn.Module], Any] | None, rng_state: torch.Tensor | None
) -> set[str]:
    """Initialise ``module`` as its unsharded self would be, module by module (parents first,
    in registration order, the order ``nn.Module.__init__`` builds them), each module's own
    sharded parameters standing in full on the CPU while it runs: ``init_fn(module)`` for
    every module, else ``reset_parameters()`` where a module has one (``_reset_parameters`` for
    ``nn.MultiheadAttention``, after its children, as its ``__init__`` does). A tensor shared by two
    modules keeps the first one's values (the later draw is discarded, as tying after
    construction does). With ``rng_state`` (the processes' RNG states differ) the draws come
    from that state, and the global RNG is left as it was. Returns the first names of what was
    initialised."""
    from torch.distributed.tensor import DTensor

    alias, _ = tensor_names(module)
    done: set[int] = set()
    filled: set[str] = set()
    rng = torch.random.fork_rng(devices=[]) if rng_state is not None else contextlib.nullcontext()
    with rng, torch.no_grad():
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        for prefix, m in _init_order(module):
            call = (lambda m=m: init_fn(m)) if init_fn is not None else _reset_of(m)
            if not callable(call):
                continue
            stand_ins = []  # (store, name, tensor, its full stand-in, whether its values are kept)
            for store, name, t in _own(m):
                first = id(t) not in done
                if isinstance(t, DTensor) or not first:
                    full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    stand = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
                    stand_ins.append((store, name, t, stand, first))
                    store[name] = stand
                if first:
                    done.add(id(t))
                    full_name = (f"{prefix}.{name}" if prefix else name).replace(_CHECKPOINT_WRAPPER, "")
                    filled.add(alias.get(full_name, full_name))
            try:
                call()
            finally:
                for store, name, t, _, _ in stand_ins:
                    store[name] = t
            for _, _, t, stand, first in stand_ins:
                if first:
                    copy_part(t, stand.detach())
    return filled


# ---------------------------------------------------------------------------- unfilled
def mark_unfilled(module: nn.Module, names: set[str]) -> None:
    """Record what nothing has filled; the first forward refuses to run while any is left."""
    if not names:
        return
    setattr(module, UNFILLED, set(names))

    def refuse(mod: nn.Module, args: Any) -> None:
        require_filled(mod, "forward")

    module._hasten_unfilled_hook = module.register_forward_pre_hook(refuse, prepend=True)  # before FSDP gathers


def mark_filled(module: nn.Module, names: Any) -> None:
    """``names`` (state-dict keys) now hold real values; once nothing is left the forward
    check is removed (no cost per step)."""
    left = getattr(module, UNFILLED, None)
    if not left:
        return
    alias, _ = tensor_names(module)
    left.difference_update(alias.get(n, n) for n in names)
    if not left:
        delattr(module, UNFILLED)
        module._hasten_unfilled_hook.remove()
        del module._hasten_unfilled_hook


def require_filled(module: nn.Module, what: str) -> None:
    left = getattr(module, UNFILLED, None)
    if not left:
        return
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:  # fully_shard's FSDP<Model> class
        cls = cls.__bases__[1]
    names = sorted(left)
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    raise RuntimeError(
        f"{what}: {cls.__name__} was built on the meta device and nothing has filled {shown} "
        "(a module without reset_parameters, or a buffer no checkpoint holds); they would be garbage. "
        "Load the weights after prepare (accelerator.load_state(...) or accelerator.load_model(model, path)), "
        "give those modules a reset_parameters(), or pass FullyShardedDataParallelPlugin(param_init_fn=...)"
    )
