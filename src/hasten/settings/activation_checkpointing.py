"""Activation checkpointing: which activations a block keeps for backward, and which it recomputes.

``FullyShardedDataParallelPlugin.activation_checkpointing`` takes ``True``/``"full"``,
``"selective"``, ``"memory_budget"`` or an :class:`ActivationCheckpointingConfig` (torchtitan's
``activation_checkpoint`` section, by another name):

- ``"full"``: each block keeps only its inputs and recomputes everything in backward (torch's
  ``checkpoint_wrapper``).
- ``"selective"``: op-level selective checkpointing (torch's
  ``create_selective_checkpoint_contexts``): the outputs of matrix products, attention kernels and
  collectives are kept, the cheap element-wise ops between them recomputed; with
  ``selective_save="every_other_matmul"`` every second matrix product is recomputed too
  (torchtitan's op policy). Less memory than no checkpointing, less recomputation than full.
- ``"memory_budget"``: no wrapper; ``torch.compile``'s partitioner keeps the activations that fit
  ``memory_budget`` (0: recompute all it can, 1: keep what it would without checkpointing) by
  ``torch._functorch.config.activation_memory_budget``. Needs ``torch.compile`` (a
  ``TorchDynamoPlugin``), refused without it.

``every_nth_block`` checkpoints one block in n (torchtitan's layer-selective option), the others
keep all their activations. The torch objects are built here, lazily, by
:meth:`ActivationCheckpointingConfig.wrapper` (its one caller: the FSDP plugin's
``checkpoint_wrapper``). Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hasten import _validate as v

#: what ``activation_checkpointing`` may name
AC_MODES = ("full", "selective", "memory_budget")
#: which op outputs selective checkpointing keeps
SELECTIVE_SAVES = ("matmuls", "every_other_matmul")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """How blocks are checkpointed (see the module docstring)."""

    mode: str = "full"
    #: ``"selective"``: keep every matrix product's output ("matmuls"), or every other one
    selective_save: str = "matmuls"
    #: checkpoint one block in ``every_nth_block`` (1: every block); not with ``"memory_budget"``
    every_nth_block: int = 1
    #: ``"memory_budget"``: the fraction of the activations compile's partitioner may keep (0 to 1)
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        owner = "ActivationCheckpointingConfig"
        v.check_choice(owner, "mode", self.mode, AC_MODES)
        v.check_choice(owner, "selective_save", self.selective_save, SELECTIVE_SAVES)
        v.check_number(owner, "every_nth_block", self.every_nth_block, integer=True, ge=1)
        if self.mode == "memory_budget":
            if self.memory_budget is None:
                raise ValueError(
                    f"{owner}(mode='memory_budget') needs memory_budget, the fraction of the activations "
                    "torch.compile may keep (0: recompute all it can, 1: keep them all), e.g. memory_budget=0.5"
                )
            v.check_number(owner, "memory_budget", self.memory_budget, ge=0, le=1)
            if self.every_nth_block != 1:
                raise ValueError(
                    f"{owner}(mode='memory_budget', every_nth_block={self.every_nth_block}): the budget applies to "
                    "the whole compiled graph, not to chosen blocks; leave every_nth_block 1"
                )
        elif self.memory_budget is not None:
            raise ValueError(
                f"{owner}.memory_budget={v.shown(self.memory_budget)} is for mode='memory_budget', not "
                f"mode={self.mode!r}; leave it None or set mode='memory_budget'"
            )

    @property
    def wraps(self) -> bool:
        """Whether blocks get a checkpoint wrapper (not under a memory budget)."""
        return self.mode != "memory_budget"

    def wrapper(self, offload: bool = False, pin_memory: bool = False) -> Any:
        """The wrapper ``apply_activation_checkpointing`` puts around each checkpointed block:
        torch's ``checkpoint_wrapper`` (non-reentrant), with the selective policy's contexts, its
        checkpoint run under ``save_on_cpu`` with ``offload``."""
        from functools import partial

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        kwargs: dict[str, Any] = {"checkpoint_fn": CheckpointKeepingBuffers(offload, pin_memory)}
        if self.mode == "selective":
            kwargs["context_fn"] = SelectiveContexts(self.selective_save == "every_other_matmul")
        return partial(checkpoint_wrapper, **kwargs)


def as_config(owner: str, field: str, value: Any) -> ActivationCheckpointingConfig | None:
    """``activation_checkpointing`` as given (a bool, a mode's name, a config) as a config, or None (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return ActivationCheckpointingConfig()
    if isinstance(value, ActivationCheckpointingConfig):
        return value
    if isinstance(value, str):
        mode = v.check_choice(owner, field, value.strip().lower(), AC_MODES)
        if mode == "memory_budget":
            raise ValueError(
                f"{owner}.{field}='memory_budget' needs a budget: pass ActivationCheckpointingConfig("
                "mode='memory_budget', memory_budget=0.5) (the fraction of the activations torch.compile may keep)"
            )
        return ActivationCheckpointingConfig(mode=mode)
    raise TypeError(
        f"{owner}.{field} must be True or False, one of {', '.join(map(repr, AC_MODES))} or an "
        f"ActivationCheckpointingConfig, got {v.shown(value)} ({type(value).__name__})"
    )


# ---------------------------------------------------------------------------- the torch side
def _saved_ops() -> frozenset[Any]:
    """The ops whose outputs selective checkpointing keeps: matrix products, attention kernels,
    collectives (recomputing one would communicate again) and ``max`` (torchtitan's list)."""
    import torch

    aten, c10d, c10d_autograd = torch.ops.aten, torch.ops._c10d_functional, torch.ops._c10d_functional_autograd
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (aten, "_scaled_mm"),
        (aten, "max"),
        (c10d, "reduce_scatter_tensor"),
        (c10d, "all_gather_into_tensor"),
        (c10d, "all_to_all_single"),
        (c10d, "all_reduce"),
        (c10d_autograd, "all_to_all_single"),
        (c10d_autograd, "reduce_scatter_tensor"),
        (c10d_autograd, "all_gather_into_tensor"),
    ]
    found = [getattr(ns, name, None) for ns, name in names]
    return frozenset(op.default for op in found if op is not None and hasattr(op, "default"))


class SelectiveContexts:
    """``checkpoint``'s ``context_fn``: each call (one per checkpointed forward) a fresh policy
    and torch's selective checkpoint contexts for the forward and its recomputation."""

    def __init__(self, every_other_matmul: bool) -> None:
        self.every_other_matmul = every_other_matmul
        self._saved: frozenset[Any] | None = None

    def __call__(self) -> Any:
        import torch
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        if self._saved is None:
            self._saved = _saved_ops()
        saved, alternate = self._saved, self.every_other_matmul
        matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        counts = {False: 0, True: 0}  # matrix products seen in the forward, and in its recomputation

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if alternate and func in matmuls:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)


class CheckpointKeepingBuffers:
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) whose recomputation leaves the block's
    buffers as the forward left them: torch's recomputes the forward in backward, so a buffer the
    forward writes (BatchNorm's running statistics and ``num_batches_tracked``, any counter kept in
    a buffer) would be updated twice per step. In a block that holds buffers, they are copied before
    the recomputation and put back after it (a copy of each per backward); the recomputation's
    outputs are unchanged (BatchNorm in training normalises by the batch's statistics). Compiled
    code is left to the compiler (its graphs apply a mutation once). With ``offload``, under
    ``save_on_cpu``: what the block saves for its recomputation (its inputs) waits for backward in
    CPU memory, as torch's ``offload_wrapper`` around a ``checkpoint_wrapper`` does, with pinned
    memory only where there is a GPU to copy to."""

    def __init__(self, offload: bool = False, pin_memory: bool = False) -> None:
        self.offload, self.pin_memory = offload, pin_memory

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.utils.checkpoint import checkpoint, noop_context_fn

        if not torch.compiler.is_compiling() and torch.is_grad_enabled():
            owners = _buffer_owners(function)
            if owners:
                kwargs["context_fn"] = _KeepBuffers(owners, kwargs.get("context_fn", noop_context_fn))
        if not self.offload:
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)


_OWNERS: Any = None  # block -> [(submodule path, buffer name)], a WeakKeyDictionary made at first use


def _buffer_owners(module: Any) -> list[tuple[Any, str]]:
    """(submodule, name) of every buffer of ``module``: their places found once per block, the
    modules and tensors read at each call (FSDP and ``.to()`` replace the tensors)."""
    global _OWNERS
    import torch

    if not isinstance(module, torch.nn.Module):  # a function: no buffers to keep
        return []
    if _OWNERS is None:
        import weakref

        _OWNERS = weakref.WeakKeyDictionary()
    places = _OWNERS.get(module)
    if places is None:
        places = _OWNERS[module] = [
            (p, n) for p, m in module.named_modules() for n, b in m._buffers.items() if b is not None
        ]
    return [(module.get_submodule(p), n) for p, n in places]


class _KeepBuffers:
    """``checkpoint``'s ``context_fn`` for one checkpointed call, around ``inner``'s contexts (the
    selective policy's, or none): the recomputation's context copies the block's buffers before it
    and puts them back after it, outside ``inner``'s (a selective policy never sees the copies).
    Every buffer is kept: BatchNorm updates its running statistics without bumping their version
    counters, so which ones the forward wrote cannot be told without comparing (a host sync)."""

    def __init__(self, owners: list[tuple[Any, str]], inner: Any) -> None:
        self.owners, self.inner = owners, inner

    def __call__(self) -> tuple[Any, Any]:
        import torch

        forward, recompute = self.inner()
        buffers = [m._buffers.get(n) for m, n in self.owners]
        return forward, _restoring(recompute, [b for b in buffers if isinstance(b, torch.Tensor)])


@contextlib.contextmanager
def _restoring(inner: Any, buffers: list[Any]) -> Iterator[None]:
    import torch

    kept = [(b, b.detach().clone()) for b in buffers]
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)
