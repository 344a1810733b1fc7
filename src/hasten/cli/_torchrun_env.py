"""Launch settings from torchrun's ``PET_*`` variables (Kubeflow Trainer's PyTorch runtime sets them).

torchrun takes each of its flags from ``PET_<FLAG>`` when the flag is not given; ``hasten launch``
reads the same five Kubeflow sets, a flag given winning (a disagreement is named in a warning):

- ``num_machines`` (and ``max_machines``) from ``PET_NNODES`` (``N`` or ``MIN:MAX``)
- ``num_processes``  ``PET_NPROC_PER_NODE`` x machines: a number, or torchrun's ``gpu`` (the GPUs),
  ``cpu`` (the CPU cores) or ``auto`` (the GPUs, else the CPU cores)
- ``machine_rank`` from ``PET_NODE_RANK``, ``main_process_ip`` from ``PET_MASTER_ADDR``,
  ``main_process_port`` from ``PET_MASTER_PORT``

Nothing here imports torch unless ``PET_NPROC_PER_NODE`` is ``gpu`` or ``auto``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hasten.settings import environment as e

#: setting -> the flags of hasten launch that give it (for the disagreement warning)
_FLAGS = {
    "num_machines": "--num_machines/--nnodes",
    "max_machines": "--nnodes MIN:MAX",
    "num_processes": "--num_processes/--nproc_per_node",
    "machine_rank": "--machine_rank/--node_rank",
    "main_process_ip": "--main_process_ip/--master_addr",
    "main_process_port": "--main_process_port/--master_port",
}


def _number(name: str, raw: str, low: int) -> int:
    text = raw.strip()
    if not text.isdigit() or int(text) < low:
        raise ValueError(f"environment variable {name} must be a number >= {low} (as torchrun reads it), got {raw!r}")
    return int(text)


def _per_machine(raw: str) -> int:
    """``PET_NPROC_PER_NODE`` as torchrun reads it (its ``determine_local_world_size``)."""
    text = raw.strip().lower()
    if text.isdigit():
        return _number(e.PET_NPROC_PER_NODE, text, 1)
    if text not in ("cpu", "gpu", "auto"):
        raise ValueError(
            f"environment variable {e.PET_NPROC_PER_NODE} must be a number >= 1, 'gpu', 'cpu' or 'auto' "
            f"(as torchrun reads it), got {raw!r}"
        )
    if text != "cpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise ValueError(f"environment variable {e.PET_NPROC_PER_NODE}='gpu', but no CUDA GPU is visible here")
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def pet_settings(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The launch settings the ``PET_*`` variables tell, each with the variable it came from (empty without them)."""
    out: dict[str, tuple[Any, str]] = {}
    raw = (environ.get(e.PET_NNODES) or "").strip()
    if raw:
        low, colon, high = raw.partition(":")
        machines = _number(e.PET_NNODES, low, 1)
        out["num_machines"] = (machines, e.PET_NNODES)
        if colon:
            most = _number(e.PET_NNODES, high, machines)
            if most != machines:
                out["max_machines"] = (most, e.PET_NNODES)
    raw = (environ.get(e.PET_NPROC_PER_NODE) or "").strip()
    if raw:
        machines = out.get("num_machines", (1, ""))[0]
        out["num_processes"] = (_per_machine(raw) * machines, f"{e.PET_NPROC_PER_NODE} x machines")
    raw = (environ.get(e.PET_NODE_RANK) or "").strip()
    if raw:
        out["machine_rank"] = (_number(e.PET_NODE_RANK, raw, 0), e.PET_NODE_RANK)
    raw = (environ.get(e.PET_MASTER_ADDR) or "").strip()
    if raw:
        out["main_process_ip"] = (raw, e.PET_MASTER_ADDR)
    raw = (environ.get(e.PET_MASTER_PORT) or "").strip()
    if raw:
        port = _number(e.PET_MASTER_PORT, raw, 1)
        if port > 65535:
            raise ValueError(f"environment variable {e.PET_MASTER_PORT} must be a port in 1..65535, got {raw!r}")
        out["main_process_port"] = (port, e.PET_MASTER_PORT)
    return out


def disagreements(pet: Mapping[str, tuple[Any, str]], resolved: Mapping[str, tuple[Any, str]]) -> list[str]:
    """A warning for each ``PET_*`` setting that a flag overrides with another value."""
    out = []
    for name, (value, variable) in pet.items():
        got, source = resolved.get(name, (None, ""))
        if source == "flag" and got != value:
            out.append(
                f"hasten launch: warning: {_FLAGS.get(name, name)} {got} overrides {variable} (torchrun's variable, "
                f"which says {name} {value}); using {got}"
            )
    return out
