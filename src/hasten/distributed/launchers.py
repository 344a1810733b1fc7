"""Launching a function on several processes from Python: ``debug_launcher`` and ``notebook_launcher``.

Both are Accelerate's functions with Accelerate's signatures. ``debug_launcher`` starts CPU
processes with ``torch.multiprocessing`` and gives them a real gloo group (a file store, so no
port can clash); ``notebook_launcher`` runs the function under torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``), as ``hasten launch`` runs a script.
Imported on first use of either name, so ``import hasten`` does not pay for it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.choices import MIXED_PRECISION_CHOICES, RDZV_BACKENDS


def _start_method() -> str:
    """``fork`` where the platform has it (the function need not be picklable, as in Accelerate)."""
    import torch.multiprocessing as mp

    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _refuse_if_running(launcher: str) -> None:
    import torch.distributed as dist

    from hasten.distributed.state import _current

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{launcher}() cannot start processes from a process that is already in a process group: "
            "call it from a plain Python process (or destroy the group first)"
        )
    if _current:
        raise RuntimeError(
            f"{launcher}() must be called before any Accelerator exists in this process: create the "
            "Accelerator inside the launched function"
        )


class _DebugWorker:
    """What each ``debug_launcher`` process runs: its rank's environment, the gloo group, ``function``."""

    def __init__(self, function: Callable, num_processes: int, store_path: str) -> None:
        self.function = function
        self.num_processes = num_processes
        self.store_path = store_path

    def __call__(self, index: int, *args: Any) -> None:
        import torch.distributed as dist

        from hasten.distributed.state import _current

        _current.clear()  # a forked child starts with no Accelerator of its own
        n = str(self.num_processes)
        env.export(
            {
                env.RANK: str(index),
                env.LOCAL_RANK: str(index),
                env.WORLD_SIZE: n,
                env.LOCAL_WORLD_SIZE: n,
                env.GROUP_RANK: "0",
                env.MASTER_ADDR: "127.0.0.1",
                env.HASTEN_USE_CPU: "1",
                env.HASTEN_MIXED_PRECISION: "no",
            }
        )
        dist.init_process_group(
            "gloo", store=dist.FileStore(self.store_path, self.num_processes), rank=index, world_size=self.num_processes
        )
        try:
            self.function(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes joined in a gloo process group.

    For tests and debugging (as in Accelerate): every process uses the CPU and mixed precision
    is off. An exception in any process is raised here (``ProcessRaisedException``, with that
    process's traceback).
    """
    if not callable(function):
        raise TypeError(f"debug_launcher.function must be callable, got {function!r}")
    v.check_number("debug_launcher", "num_processes", num_processes, integer=True, ge=1)
    if not isinstance(args, tuple):
        raise TypeError(f"debug_launcher.args must be a tuple, got {type(args).__name__}")
    _refuse_if_running("debug_launcher")
    from torch.multiprocessing import start_processes

    with tempfile.TemporaryDirectory(prefix="hasten-debug-") as tmp:
        worker = _DebugWorker(function, num_processes, os.path.join(tmp, "store"))
        start_processes(worker, args=args, nprocs=num_processes, start_method=_start_method())


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (CPU or GPU).

    As in Accelerate: ``num_processes`` defaults to the number of GPUs (required without GPUs);
    with one process the function simply runs here; with more, torch's elastic agent starts
    them (``elastic_launch``), on ``num_nodes`` machines when this is machine ``node_rank``, with
    the rendezvous at ``master_addr:use_port`` (static) or ``rdzv_endpoint`` (c10d).
    ``mixed_precision`` ("no", "fp16", "bf16") is what the Accelerators created inside use by
    default. No Accelerator (and no process group) may exist in this process beforehand.
    Returns nothing, as Accelerate's; a failing process raises ``ChildFailedError``.
    """
    if not callable(function):
        raise TypeError(f"notebook_launcher.function must be callable, got {function!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"notebook_launcher.args must be a tuple, got {type(args).__name__}")
    mixed_precision = v.check_choice(
        "notebook_launcher", "mixed_precision", str(mixed_precision).lower(), MIXED_PRECISION_CHOICES
    )
    v.check_number("notebook_launcher", "num_nodes", num_nodes, integer=True, ge=1)
    v.check_number("notebook_launcher", "node_rank", node_rank, integer=True, ge=0)
    if node_rank >= num_nodes:
        raise ValueError(f"notebook_launcher.node_rank must be less than num_nodes={num_nodes}, got {node_rank}")
    rdzv_backend = v.check_choice("notebook_launcher", "rdzv_backend", rdzv_backend, RDZV_BACKENDS)
    v.check_number("notebook_launcher", "max_restarts", max_restarts, integer=True, ge=0)
    if num_processes is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "notebook_launcher.num_processes is required without GPUs: pass num_processes=... "
                "(the number of CPU processes to start)"
            )
        num_processes = torch.cuda.device_count()
    v.check_number("notebook_launcher", "num_processes", num_processes, integer=True, ge=1)
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise ValueError(f"notebook_launcher.use_port must be a port number, got {use_port!r}") from None

    exported = {env.HASTEN_MIXED_PRECISION: mixed_precision}
    if num_processes == 1 and num_nodes == 1:
        with env.patched(exported):
            function(*args)
        return
    _refuse_if_running("notebook_launcher")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv_conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_conf["rank"] = node_rank
        rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{port}"
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=rdzv_id,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=_start_method(),
        log_line_prefix_template=log_line_prefix_template,
    )
    with env.patched(exported):
        elastic_launch(config=config, entrypoint=function)(*args)
