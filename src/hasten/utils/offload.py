"""``accelerate.utils.offload``: weights kept in an offload folder (``offload_weight``,
``offload_state_dict``, ``save_offload_index``, ``load_offloaded_weight``), read back lazily
(``OffloadedWeightsLoader``, ``PrefixedDataset``), and ``extract_submodules_state_dict``. They live
in ``hasten.big_model.offload`` (raw ``.dat`` files or the checkpoint's safetensors; never unpickled)."""

from hasten.big_model.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]
