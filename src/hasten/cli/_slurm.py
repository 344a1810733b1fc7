"""Launch settings from a SLURM allocation, for ``srun hasten launch ...`` (one launcher per node).

Under ``srun`` (``SLURM_STEP_ID`` is set) the settings not given as flags come from SLURM:

- ``num_machines``   from ``SLURM_NNODES``
- ``machine_rank``   from ``SLURM_NODEID``
- ``main_process_ip`` the first host of ``SLURM_JOB_NODELIST`` (else ``SLURM_NODELIST``),
  compressed lists such as ``node[01-04,07]`` included
- ``num_processes``  processes per machine x machines: per machine ``SLURM_GPUS_ON_NODE``
  (the GPUs SLURM gave this node), else ``SLURM_NTASKS_PER_NODE``

Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hasten.settings import environment


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07],gpu5`` -> ``node01``,
    ``rack[1-2]-n[3,5]`` -> ``rack1-n3``."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first entry: up to the first comma outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            end = i
            break
    entry = text[:end]
    if depth < 0 or entry.count("[") != entry.count("]") or not entry:
        raise ValueError(
            f"SLURM node list: cannot read {nodelist!r} (expected e.g. 'node01,node02' or 'node[01-04,07]')"
        )

    def first(match: re.Match[str]) -> str:
        item = match.group(1).split(",")[0].strip()
        low = item.split("-")[0].strip()
        if not low.isdigit():
            raise ValueError(f"SLURM node list: cannot read the range [{match.group(1)}] in {nodelist!r}")
        return low

    host = re.sub(r"\[([^\[\]]*)\]", first, entry)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", host):
        raise ValueError(f"SLURM node list: {nodelist!r} does not start with a host name (got {host!r})")
    return host


def _count(name: str, raw: str) -> int:
    """A SLURM count such as ``4`` or ``4(x2)`` (4 on each of 2 nodes): its first number."""
    match = re.match(r"\s*(\d+)", raw)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"environment variable {name} must be a number >= 1 such as '4' or '4(x2)', got {raw!r}")
    return int(match.group(1))


def slurm_settings(environ: Mapping[str, str], cpu: bool = False) -> dict[str, tuple[Any, str]]:
    """The launch settings a SLURM step tells, each with the variable it came from (empty outside ``srun``).

    ``cpu``: processes per machine do not come from the node's GPUs."""
    e = environment
    if not environ.get(e.SLURM_STEP_ID) and not environ.get(e.SLURM_STEPID):
        return {}
    out: dict[str, tuple[Any, str]] = {}
    if environ.get(e.SLURM_NNODES):
        out["num_machines"] = (_count(e.SLURM_NNODES, environ[e.SLURM_NNODES]), e.SLURM_NNODES)
    raw = environ.get(e.SLURM_NODEID)
    if raw:
        if not raw.strip().isdigit():
            raise ValueError(f"environment variable {e.SLURM_NODEID} must be a number >= 0, got {raw!r}")
        out["machine_rank"] = (int(raw), e.SLURM_NODEID)
    for name in (e.SLURM_JOB_NODELIST, e.SLURM_NODELIST):
        if environ.get(name):
            out["main_process_ip"] = (first_host(environ[name]), name)
            break
    per_machine = None
    for name in (e.SLURM_NTASKS_PER_NODE,) if cpu else (e.SLURM_GPUS_ON_NODE, e.SLURM_NTASKS_PER_NODE):
        if environ.get(name):
            per_machine = (_count(name, environ[name]), name)
            break
    if per_machine is not None:
        machines = out.get("num_machines", (1, ""))[0]
        out["num_processes"] = (per_machine[0] * machines, f"{per_machine[1]} x machines")
    return out
