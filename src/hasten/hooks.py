"""``accelerate.hooks``'s names at Accelerate's path; they live in ``hasten.big_model``
(``hooks``: the mechanism; ``align`` and ``blocks``: the hooks that move weights between devices)."""

from hasten.big_model.align import (
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    UserCpuOffloadHook,
    attach_align_device_hook,
    attach_execution_device_hook,
)
from hasten.big_model.blocks import attach_align_device_hook_on_blocks
from hasten.big_model.hooks import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
