"""torch.compile for prepared models: the whole model, or its repeated blocks (regional).

Consumes ``TorchDynamoPlugin`` (``compile_kwargs()`` gives the ``torch.compile`` arguments), once,
when the Accelerator chooses its strategy: a ``Compiler`` is the compile step of the parallelize
plan. The pipeline (``strategies/parallelize.py``) applies it at ``prepare``, in the order that
works with the strategy's wrapper:

- regional compilation compiles each repeated block *in place* (``nn.Module.compile``), before
  the strategy wraps the model (torchtitan's order for FSDP2: compile each block, then shard;
  without regional compilation FSDP's blocks are compiled so, one by one: ``apply_compile``);
  the module tree, its parameter names and its hooks are unchanged, and the blocks share one
  compiled graph, so the cold start is one block's compile, not the whole model's;
- whole-model compilation wraps the *wrapped* model, ``torch.compile(DDP(model))`` as torch
  recommends (Dynamo splits the graph at DDP's bucket boundaries), and returns the
  ``OptimizedModule``, as Accelerate does.

Checkpoints never see the compiled wrapper: strategies unwrap it (``_orig_mod.``) before taking
state dicts.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hasten.settings.plugins import TorchDynamoPlugin


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``).

    Without ``torch._dynamo`` imported no module can be compiled, so this imports nothing.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile``'s wrappers, else ``module``."""
    while is_compiled(module):
        module = module._orig_mod
    return module


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``module``: in each container, the children of a class that occurs
    more than once there and that have children of their own (a transformer's layers, not its
    Linear layers); the search does not descend into a block it found."""
    found: list[torch.nn.Module] = []

    def visit(parent: torch.nn.Module) -> None:
        children = list(parent.children())
        counts = Counter(type(c) for c in children)
        for child in children:
            if counts[type(child)] > 1 and any(True for _ in child.children()):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


class Compiler:
    """Compiles prepared models as a ``TorchDynamoPlugin`` says."""

    def __init__(self, plugin: TorchDynamoPlugin) -> None:
        from hasten.settings.plugins import available_backends

        known = available_backends()
        if plugin.backend not in known:
            raise ValueError(
                f"TorchDynamoPlugin.backend={plugin.backend!r} is not a torch.compile backend of this torch "
                f"{torch.__version__}; choices: {', '.join(map(repr, ['no', *known]))}"
            )
        self.plugin = plugin
        self.kwargs = plugin.compile_kwargs()
        self.regional = bool(plugin.use_regional_compilation)

    def compile_regions(self, module: torch.nn.Module) -> bool:
        """Compile each repeated block of ``module`` in place; False if it has none (then the
        whole model is compiled after wrapping, with a warning) or is compiled already."""
        if is_compiled(module):
            return True
        blocks = repeated_blocks(module)
        if not blocks:
            warnings.warn(
                f"TorchDynamoPlugin(use_regional_compilation=True): {type(module).__name__} has no repeated blocks "
                "(children of one class occurring more than once); compiling the whole model instead",
                stacklevel=6,  # prepare_model, through the pipeline (parallelize.apply_compile)
            )
            return False
        for block in blocks:
            block.compile(**self.kwargs)
        return True

    def compile_whole(self, module: torch.nn.Module) -> torch.nn.Module:
        """``torch.compile(module)``, unless it is compiled already."""
        if is_compiled(module):
            return module
        return torch.compile(module, **self.kwargs)
