"""``accelerate.utils.versions``: compare an installed library's version (or a version) with a requirement.

Versions are read with ``importlib.metadata`` and parsed with ``packaging.version`` where it is
installed (Accelerate's type, so a ``packaging.version.Version`` passed in compares), else with the
copy torch vendors (``torch._vendor.packaging``). Nothing is imported until a function is called.
"""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["compare_versions", "is_torch_version"]

#: Accelerate's ``accelerate.utils.constants.STR_OPERATION_TO_FUNC``
STR_OPERATION_TO_FUNC: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _version_class() -> type:
    try:
        from packaging.version import Version
    except ImportError:  # packaging is not a dependency of hasten; torch vendors a copy
        from torch._vendor.packaging.version import Version
    return Version


def _installed(owner: str, distribution: str) -> Any:
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise importlib.metadata.PackageNotFoundError(
            f"{owner}: {distribution!r} is not an installed distribution; pass a distribution's name "
            "(such as 'torch') or a packaging.version.Version"
        ) from None
    return _version_class()(text)


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Whether ``library_or_version`` (an installed distribution's name, or a ``Version``) stands in
    ``operation`` (one of ``>``, ``>=``, ``==``, ``!=``, ``<=``, ``<``) to ``requirement_version``.

    As Accelerate's: ``compare_versions("torch", ">=", "2.4")``. A name that is not installed is a
    ``PackageNotFoundError`` naming it.
    """
    compare = STR_OPERATION_TO_FUNC.get(operation) if isinstance(operation, str) else None
    if compare is None:
        raise ValueError(
            f"compare_versions.operation must be one of {', '.join(map(repr, STR_OPERATION_TO_FUNC))}, "
            f"got {operation!r}"
        )
    if isinstance(library_or_version, str):
        found = _installed("compare_versions", library_or_version)
        version_class = type(found)
    else:
        found = library_or_version
        version_class = type(found) if hasattr(found, "release") else _version_class()
    return compare(found, version_class(str(requirement_version)))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch stands in ``operation`` to ``version``: ``is_torch_version(">=", "2.6")``."""
    return compare_versions(_torch_version(), operation, version)


def _torch_version() -> Any:
    return _installed("is_torch_version", "torch")


def __getattr__(name: str) -> Any:
    # Accelerate's module attribute ``torch_version`` (the installed torch's Version), parsed on first use.
    if name == "torch_version":
        return _torch_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
