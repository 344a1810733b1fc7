"""``infer_auto_device_map``: Accelerate's device-map planner, map for map.

The model's direct parameters, children and buffers are taken in order and put on the current
device while they fit (the accelerators by id, then "cpu", then "disk", which takes everything).
On the main devices (the first accelerator and the CPU; "mps" alone where it is the accelerator)
room for the largest layer still to place is kept free, for a layer brought back from where it
was offloaded. A module that does not fit is split into its parameters and children unless it
is a leaf or of a no-split class, else the next device is taken. Tied parameters go with the
module that holds the other end of the tie (that module is split if the pair does not fit).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from hasten.big_model.planning import (
    _children,
    _no_split_list,
    _outside_ties,
    clean_device_map,
    fallback_allocate,
    get_max_memory,
    get_module_size_with_ties,
)
from hasten.big_model.tensors import (
    check_tied_parameters_in_config,
    compute_module_sizes,
    compute_module_total_buffer_size,
    find_tied_parameters,
    get_max_layer_size,
)

__all__ = ["infer_auto_device_map"]

logger = logging.getLogger(__name__)


class _Planner:
    """The state of one ``infer_auto_device_map`` run (Accelerate's loop, one step a method)."""

    def __init__(self, model: nn.Module, max_memory: Any, no_split: Any, dtype: Any, special_dtypes: Any) -> None:
        self.max_memory = get_max_memory(max_memory)
        self.no_split = _no_split_list(no_split)
        self.devices = list(self.max_memory) + ([] if "disk" in self.max_memory else ["disk"])
        self.gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        if "mps" in self.gpus:
            self.main_devices = ["mps"]
        else:
            self.main_devices = [self.gpus[0], "cpu"] if self.gpus else ["cpu"]
        self.dtype, self.special_dtypes = dtype, special_dtypes
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
        self.tied = find_tied_parameters(model)
        if check_tied_parameters_in_config(model) and not self.tied:
            logger.warning(
                "The model weights are not tied. Please use the `tie_weights` method before using the "
                "`infer_auto_device` function."
            )
        self.queue: list[tuple[str, Any]] = [
            *model.named_parameters(recurse=False),
            *model.named_children(),
            *model.named_buffers(recurse=False),
        ]
        self.device_map: dict[str, Any] = {}
        self.current = 0
        self.used = dict.fromkeys(self.devices, 0)
        self.buffer_sizes: dict[Any, int] = {}
        self.minimum: dict[Any, int] = {}
        self.largest, self.largest_names = get_max_layer_size(self.queue, self.sizes, self.no_split)
        self.verbose = False

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def _relargest(self) -> None:
        """The largest layer still to place (only modules count, as in Accelerate)."""
        modules = [(n, m) for n, m in self.queue if isinstance(m, nn.Module)]
        self.largest, self.largest_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def step(self, offload_buffers: bool, fallback: bool) -> None:
        """Place, split or pass over the next entry of the queue."""
        name, module = self.queue.pop(0)
        self._say(f"\nTreating module {name}.")
        self.largest_names = [n for n in self.largest_names if n != name and not n.startswith(name + ".")]
        if not self.largest_names:
            self._relargest()
        size = self.sizes[name]
        ties = _outside_ties(name, self.tied)
        device = self.devices[self.current]
        cap = self.max_memory[device] if device != "disk" else None
        reserved = 0
        if device in self.main_devices:
            cap, reserved = cap - self.largest, self.largest
        with_ties, tied_names, tied_modules = get_module_size_with_ties(ties, size, self.sizes, self.queue)
        if cap is None or self.used[device] + with_ties <= cap:
            self._place(name, module, device, with_ties, tied_names, offload_buffers)
            return
        if ties and self.used[device] + size <= cap and self._split_tied(name, module, tied_names, tied_modules):
            return
        if self.used[device] + size >= cap and self._split(name, module):
            return
        if self.used[device] == 0 and fallback and device != "disk" and self._fallback(name, module, with_ties):
            return
        if self.used[device] == 0:
            self.minimum[device] = with_ties + reserved
        self._say(f"Going from {device} to the next device.")
        self.used[device] += reserved
        self.current += 1
        self.queue.insert(0, (name, module))

    def _place(self, name: str, module: Any, device: Any, with_ties: int, tied_names: list[str], buffers: bool) -> None:
        self._say(f"Putting {name} and {tied_names} (size={with_ties}) on {device}.")
        self.used[device] += with_ties
        self.device_map[name] = device
        for tied in tied_names:
            at = next((i for i, (n, _) in enumerate(self.queue) if n == tied), None)
            if at is not None:
                self.queue.pop(at)
            self.device_map[tied] = device
        if not buffers and isinstance(module, nn.Module):
            size = compute_module_total_buffer_size(module, dtype=self.dtype, special_dtypes=self.special_dtypes)
            self.buffer_sizes[device] = self.buffer_sizes.get(device, 0) + size

    def _split_tied(self, name: str, module: Any, tied_names: list[str], tied_modules: list[Any]) -> bool:
        """Split the first tied module that can be split, ``name`` first in the queue again."""
        for tied_name, tied_module in zip(tied_names, tied_modules):
            parts = _children(tied_module, self.no_split)
            if not parts:
                continue
            self._say(f"Splitting {tied_name}.")
            at = [n for n, _ in self.queue].index(tied_name)
            parts = [(f"{tied_name}.{n}", v) for n, v in parts]
            self.queue = [(name, module), *self.queue[:at], *parts, *self.queue[at + 1 :]]
            self._relargest()
            return True
        return False

    def _split(self, name: str, module: Any) -> bool:
        parts = _children(module, self.no_split)
        if not parts:
            return False
        self._say(f"Splitting {name}.")
        self.queue = [(f"{name}.{n}", v) for n, v in parts] + self.queue
        self._relargest()
        return True

    def _fallback(self, name: str, module: Any, with_ties: int) -> bool:
        """Put first the first module (breadth-first) that fits the empty device."""
        device = self.devices[self.current]
        limit = self.max_memory[device] - max(self.largest, with_ties) - self.used[device]
        found, found_module, rest = fallback_allocate(self.queue, self.sizes, limit, self.no_split, self.tied)
        if found_module is None:
            return False
        self.queue = [(found, found_module), (name, module), *rest]
        return True

    def warn_buffers(self, offload_buffers: bool) -> None:
        """Warn where the buffers of offloaded layers (kept on an accelerator) fit none of them."""
        offloaded = self.buffer_sizes.get("cpu", 0) + self.buffer_sizes.get("disk", 0)
        if offloaded == 0 or offload_buffers or not self.gpus:
            return
        used = {d: m for d, m in self.used.items() if m > 0}
        fits = any(m >= offloaded + used.get(d, 0) for d, m in self.max_memory.items() if d not in ("cpu", "disk"))
        if not fits:
            warnings.warn(
                f"Current model requires {offloaded} bytes of buffer for offloaded layers, which seems does not fit "
                "any GPU's remaining memory. If you are experiencing a OOM later, please consider using "
                "offload_buffers=True.",
                stacklevel=2,
            )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, Any]:
    """A device map for ``model`` (module name -> accelerator id, "cpu" or "disk"), the same map
    Accelerate 1.16 plans for the same model and arguments: accelerators first, then the CPU, then
    the disk, within ``max_memory`` (``get_max_memory``'s budgets: measured when None), keeping room
    on the first accelerator and the CPU for the largest layer to bring back. Modules of a class in
    ``no_split_module_classes`` are never split; sizes are counted at ``dtype`` (``special_dtypes``
    per tensor name); tied parameters are placed together. ``clean_result`` merges entries that
    share a device; ``offload_buffers``: offloaded layers' buffers are offloaded too (else counted
    as staying on an accelerator, with a warning where they fit none); ``fallback_allocation``:
    a device nothing fitted on in order gets the first module, breadth-first, that fits it.
    Works on a model on the meta device (only sizes are read)."""
    planner = _Planner(model, max_memory, no_split_module_classes, dtype, special_dtypes)
    planner.verbose = verbose
    while planner.queue:
        planner.step(offload_buffers, fallback_allocation)
    device_map = clean_device_map(planner.device_map) if clean_result else planner.device_map
    planner.warn_buffers(offload_buffers)
    if planner.minimum:
        needed = "\n".join(f"  - {d}: {m} bytes required" for d, m in planner.minimum.items())
        logger.info(
            "Based on the current allocation process, no modules could be assigned to the following devices due to "
            f"insufficient memory:\n{needed}\nThese minimum requirements are specific to this allocation attempt and "
            "may vary. Consider increasing the available memory for these devices to at least the specified minimum, "
            "or adjusting the model config."
        )
    return device_map
