"""Model weights in files: safetensors (tied weights stored once) or torch files, their tensor tables.

Tied weights are stored once in safetensors files and listed in their ``hasten_aliases``
metadata (``safetensors_payload``), which ``read_weights`` resolves again. ``tensor_table``
(names, shapes, dtypes) is what a manifest records of a model and what a load compares.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from hasten.checkpoint import files, storage, unpickle
from hasten.checkpoint.errors import UnsafeCheckpoint

ALIASES_KEY = "hasten_aliases"


def require_safetensors(what: str) -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            f"{what} writes/reads safetensors files, which needs the 'safetensors' package: "
            "pip install 'hasten[checkpoint]' (or pass safe_serialization=False for torch .bin files)"
        ) from None
    return safetensors.torch


def flat_tensors(state_dict: dict[str, Any], where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors can store (contiguous, no shared storage) and the tied names.

    A name whose tensor is the very same view as an earlier one (tied weights) is stored
    once and listed in ``aliases`` (name -> stored name); other views of a shared storage
    are copied.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple[int, str]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{where}: state_dict entry {name!r} is a {type(t).__name__}, not a tensor; safetensors stores "
                "tensors only (pass safe_serialization=False)"
            )
        t = t.detach()
        if t.numel():
            ptr = (t.untyped_storage().data_ptr(), str(t.device))
            key = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in views:
                aliases[name] = views[key]
                continue
            views[key] = name
            if ptr in storages or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            storages.add(ptr)
        tensors[name] = t.cpu()
    return tensors, aliases


def safetensors_payload(tensors: dict[str, torch.Tensor], aliases: dict[str, str], where: str) -> Callable[[Any], None]:
    """A writer of ``tensors`` as one safetensors file whose metadata lists the ``aliases``
    among them (tied names -> stored names), for ``write`` or ``replace_file``."""
    st = require_safetensors(where)
    metadata = {"format": "pt", ALIASES_KEY: json.dumps({a: t for a, t in aliases.items() if t in tensors})}
    return lambda f: f.write(st.save(tensors, metadata=metadata))


def tensor_table(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        k: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        for k, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    }


def write_weights(path: str, state_dict: dict[str, Any], safe: bool, where: str) -> None:
    if safe:
        tensors, aliases = flat_tensors(state_dict, where)
        files.write(path, safetensors_payload(tensors, aliases, where))
    else:
        files.write(path, lambda f: torch.save(state_dict, f))


def read_weights(path: str, weights_only: bool = True) -> dict[str, torch.Tensor]:
    """A model's tensors from a safetensors or torch file; a clear error for anything else (an
    ``UnsafeCheckpoint`` naming what a torch file asks to load beyond torch's allow-list, with
    ``weights_only``: ``weights_only=False`` is for trusted files only, it runs what they name)."""
    try:
        return _read_weights(path, weights_only)
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        kind = "safetensors" if path.endswith(".safetensors") else "torch tensor"
        raise ValueError(
            f"cannot read the model weights {path!r}: it is not a plain {kind} file ({type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0][:200]}); nothing was loaded"
            + (
                " (a trusted torch file holding other objects needs weights_only=False)"
                if weights_only and kind != "safetensors"
                else ""
            )
        ) from e


def _read_weights(path: str, weights_only: bool) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        st = require_safetensors("loading model weights")
        if not storage.is_url(path) and _utf8(path):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                metadata = f.metadata() or {}
            tensors = st.load_file(path, device="cpu")
        else:  # an object at a URL, in ranged reads (no whole download held twice), or a local path that
            # safetensors cannot open (it opens UTF-8 paths only: a folder named in other bytes), as load_model reads
            from hasten.checkpoint.slices import SafetensorsFile

            sf = SafetensorsFile(path)
            with storage.open_ranges(path) as f:
                tensors = sf.read_all(f)
            metadata = sf.metadata
        for name, target in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
            tensors[name] = tensors[target]
        return tensors
    what = f"cannot read the model weights {path!r}: it is not a plain torch tensor file"
    hint = " (a trusted torch file holding other objects needs weights_only=False)"
    loaded = unpickle.torch_load(path, what, weights_only, hint)
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
        raise TypeError(f"it holds a {type(loaded).__name__}, not a dict of tensors")
    return loaded


def _utf8(path: str) -> bool:
    """Whether ``path`` is text safetensors can open: not bytes of another encoding, which Python
    gives as surrogate escapes (``os.fsdecode(b"/tmp/x\\xff")``)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def compare_tensors(expected: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], where: str) -> None:
    """A clear error when the model's tensor table (names, shapes) differs from the checkpoint's."""
    missing = [k for k in current if k not in expected]
    unexpected = [k for k in expected if k not in current]
    shapes = [
        f"{k}: checkpoint {expected[k]['shape']} vs model {current[k]['shape']}"
        for k in current
        if k in expected and expected[k]["shape"] != current[k]["shape"]
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"different shapes: {'; '.join(shapes[:5])}{' ...' if len(shapes) > 5 else ''}")
        raise ValueError(f"{where} does not fit the prepared model: " + " | ".join(parts))
