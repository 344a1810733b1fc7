"""The run's timeout on every process group hasten makes: ``InitProcessGroupKwargs.timeout``'s
translation onto torch's groups and meshes.

The run's timeout is the one the default process group was made with (:func:`group_timeout`,
read from torch). Every group hasten makes gets it: the N-D mesh (:func:`init_mesh`, and its
flattened and unflattened dims, :func:`flatten_mesh`, :func:`unflatten_mesh`), FSDP's 1-D mesh,
the asynchronous saves' group; and hasten's waits for its own background work are bounded by it.
Torch only, nothing of hasten's runtime: it sits here, beside the handler, so that
``ParallelismConfig.build_device_mesh`` builds its mesh with it without reaching up into
``hasten.distributed`` (which makes the default group, in ``state.py``). Importing this module
imports torch; ``settings.parallelism`` imports it only when it builds a mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh", "group_timeout", "init_mesh", "set_timeout", "timeout_of", "unflatten_mesh"]


def group_timeout() -> timedelta | None:
    """The run's timeout: the one the default process group was made with (what
    ``InitProcessGroupKwargs.timeout`` resolved to for its backend, or what the maker of the group
    gave torch); None without a process group.

    Every group hasten makes gets it (``init_mesh``, ``flatten_mesh``, the asynchronous saves'
    group), and the training loop's waits for hasten's background work are bounded by it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    found = timeout_of(dist.group.WORLD)
    if found is None:  # a backend whose options do not say: torch's default for it
        found = dist.distributed_c10d._get_default_timeout(dist.get_backend())
    return found


def timeout_of(group: Any) -> timedelta | None:
    """The timeout torch applies to ``group``'s collectives (the longest of its device backends';
    None when none of them says)."""
    found = []
    for device in group._device_types:
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            found.append(timeout)
    return max(found, default=None)


def _timeout_options(timeout: timedelta) -> Any:
    """Backend options carrying ``timeout``, for a DeviceMesh dim (torch's ``backend_override``): a
    copy of the default group's NCCL options where it has NCCL (ProcessGroupNCCL takes no others;
    torch's ``split_group`` copies them too), else the generic options (gloo reads only the timeout)."""
    import copy

    from torch._C._distributed_c10d import Backend as C10dBackend

    world = dist.group.WORLD
    for device in world._device_types:
        backend = world._get_backend(device)
        if type(backend).__name__ == "ProcessGroupNCCL":
            options = copy.deepcopy(backend.options)
            break
    else:
        options = C10dBackend.Options(str(dist.get_backend(world)).split(",")[0].split(":")[-1], timeout)
    options._timeout = timeout
    return options


def set_timeout(groups: Iterable[Any], timeout: timedelta) -> None:
    """Give each of ``groups`` ``timeout`` where torch made it with another (torch's ``_set_pg_timeout``)."""
    for group in groups:
        if timeout_of(group) != timeout:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """torch's ``init_device_mesh`` over every process, each of its groups with the run's timeout.

    A dim over every process is left to torch, which uses the default group for it; each other
    dim gets backend options carrying the timeout, so its groups are made with it (and their
    creation waits no longer). A group torch still made with another timeout (a new group over
    every process, as torch makes when CUDA is there but the default group is gloo) gets it after.
    """
    from torch.distributed.device_mesh import init_device_mesh

    timeout = group_timeout()
    if timeout is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    world = dist.get_world_size()
    override = {dim: _timeout_options(timeout) for dim, size in enumerate(shape) if size != world}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)
    set_timeout(mesh.get_all_groups(), timeout)
    return mesh


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh._flatten(name)`` (torch's), its group with the run's timeout (see ``init_mesh``)."""
    timeout = group_timeout()
    if timeout is None:
        return mesh._flatten(name)
    options = _timeout_options(timeout) if mesh.size() != dist.get_world_size() else None
    flat = mesh._flatten(name, backend_override=options)
    set_timeout(flat.get_all_groups(), timeout)
    return flat


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with its dim ``dim`` split into dims ``names`` of ``sizes`` (torch's ``_unflatten``;
    the last innermost), each new group with the run's timeout (see ``init_mesh``)."""
    timeout = group_timeout()
    world = dist.get_world_size()
    options = {n: _timeout_options(timeout) for n, size in zip(names, sizes) if size != world} if timeout else None
    # by index: torch 2.11's _unflatten refuses a dim given by a name it has (its check is inverted)
    split = mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names, backend_override=options or None)
    if timeout is not None:
        set_timeout(split.get_all_groups(), timeout)
    return split
