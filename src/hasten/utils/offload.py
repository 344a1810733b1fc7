"""``accelerate.utils.offload``'s state-dict helpers: ``PrefixedDataset`` and
``extract_submodules_state_dict``. (Offloading weights to disk, the rest of Accelerate's module,
is big-model inference, which hasten does not have.)"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["PrefixedDataset", "extract_submodules_state_dict"]


class PrefixedDataset(Mapping):
    """A view of ``dataset`` (a mapping with string keys) under ``prefix``: ``view[key]`` is
    ``dataset[prefix + key]``. As Accelerate's, iterating gives the full keys that start with
    the prefix, and ``len`` is the whole dataset's."""

    def __init__(self, dataset: Mapping, prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)


def extract_submodules_state_dict(state_dict: dict[str, Any], submodule_names: list[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` that belong to the modules ``submodule_names``: the name
    itself or ``name.*`` (``h.1`` takes ``h.1.weight``, not ``h.10.weight``)."""
    result: dict[str, Any] = {}
    for module in submodule_names:
        result.update({k: t for k, t in state_dict.items() if k == module or k.startswith(module + ".")})
    return result
