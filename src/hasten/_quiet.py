"""Known import-time lines of other libraries that tell the user of hasten nothing, kept off the console.

transformers imports torchao when it is installed (hasten's ``fp8`` and ``test`` extras install it),
and torchao's first import logs, on every rank:

* ``Failed to load .../torchao/_C_*.so: ...`` for each CUDA kernel library its wheel ships that this
  process cannot load: on a build of torch without CUDA (no CUDA kernel loads there), or a library
  built for another Python (its ``cpython-3XY`` tag). Such a library could never have loaded here;
  nothing is missing that could be used. Any other failed load (a CUDA library on a CUDA build of
  torch, for this Python) is a real problem and is still shown.
* torch's deprecation of ``register_constant()`` on Enum subclasses, once per enum torchao registers:
  addressed to torchao's authors. The same deprecation from any other caller is still shown.

:func:`install` adds one filter to each of the two loggers (``torchao``, ``torch.utils._pytree``);
``import hasten`` and every worker of ``hasten launch`` (before the script runs) install it, so a
script that imports transformers first is quiet too under ``hasten launch``. No torch import here.
"""

from __future__ import annotations

import logging
import os
import re
import sys

_FAILED_LOAD = re.compile(r"Failed to load (?P<path>\S+\.so)\b")
_ABI_TAG = re.compile(r"\.cpython-(?P<major>\d)(?P<minor>\d+)-")
_ENUM_DEPRECATION = "is an Enum subclass and is now natively supported by torch.compile"


def _cannot_load_here(path: str) -> bool:
    """A kernel library this process could never load: CUDA code without CUDA, or another Python's."""
    tag = _ABI_TAG.search(os.path.basename(path))
    if tag is not None and (int(tag["major"]), int(tag["minor"])) != sys.version_info[:2]:
        return True
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return version is not None and getattr(version, "cuda", "") is None


def _called_from_torchao() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if "torchao" in frame.f_code.co_filename.split(os.sep):
            return True
        frame = frame.f_back
    return False


def _keep_torchao(record: logging.LogRecord) -> bool:
    failed = _FAILED_LOAD.match(record.getMessage())
    return failed is None or not _cannot_load_here(failed["path"])


def _keep_pytree(record: logging.LogRecord) -> bool:
    return _ENUM_DEPRECATION not in record.getMessage() or not _called_from_torchao()


def install() -> None:
    """Add the two filters (once; calling it again changes nothing)."""
    for name, keep in (("torchao", _keep_torchao), ("torch.utils._pytree", _keep_pytree)):
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)
