"""``accelerate.utils.tqdm``: a progress bar shown by one process per machine.

``tqdm`` (the package) is imported at the first call, not with this module.
"""

from __future__ import annotations

from typing import Any

from hasten import _validate as v
from hasten.settings import environment as env

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but each machine's local main
    one (``LOCAL_RANK`` 0) unless ``main_process_only=False``; ``disable=True`` disables it
    everywhere. As Accelerate's: a bool as the first argument is refused (it was once
    ``main_process_only``)."""
    v.check_bool("tqdm", "main_process_only", main_process_only)
    if args and isinstance(args[0], bool):
        raise ValueError(
            "Passing `True` or `False` as the first argument to hasten's `tqdm` wrapper is unsupported. "
            "Please use the `main_process_only` keyword argument instead."
        )
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError:
        raise ImportError("hasten's `tqdm` needs the `tqdm` package: pip install tqdm") from None
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = env.env_int(env.LOCAL_RANK, 0) != 0
    return _tqdm(*args, **kwargs, disable=disable)
