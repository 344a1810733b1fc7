"""``accelerate.utils.launch``: ``PrepareForLaunch`` (what ``notebook_launcher``/``debug_launcher``
run in each process in Accelerate) and ``accelerate launch``'s environment builders.

``prepare_multi_gpu_env`` and ``prepare_simple_launcher_cmd_env`` turn ``accelerate launch``'s
parsed arguments into the command and environment of its processes; hasten's launcher does that
itself (``hasten launch`` takes Accelerate's flags, and runs torch's elastic agent), so they are
refused, naming it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from hasten.distributed.state import DistributedType
from hasten.settings import environment as env

__all__ = ["PrepareForLaunch", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env"]

#: the distributed types whose processes get LOCAL_RANK/RANK from their index
_MULTI = {
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_NEURON,
}


class PrepareForLaunch:
    """``launcher`` made ready to run as process ``index`` of a launch, as Accelerate's: called
    with ``(index, *args)``, it sets ``LOCAL_RANK`` and ``RANK`` (``NPROC * NODE_RANK + index``)
    for a multi-process ``distributed_type``, or with ``debug`` joins a gloo group on the file
    store ``ACCELERATE_DEBUG_RDV_FILE`` of ``WORLD_SIZE`` processes; then sets ``FORK_LAUNCHED=1``
    and calls ``launcher(*args)``."""

    def __init__(self, launcher: Callable[..., Any], distributed_type: Any = "NO", debug: bool = False) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> None:
        if self.debug:
            import torch.distributed as dist

            world_size = int(env.require(env.WORLD_SIZE))
            store = dist.FileStore(env.require("ACCELERATE_DEBUG_RDV_FILE"), world_size)
            dist.init_process_group("gloo", rank=index, store=store, world_size=world_size)
        elif self.distributed_type in _MULTI:
            nproc = int(env.get("NPROC", "1"))
            node_rank = int(env.get("NODE_RANK", "0"))
            env.export({env.LOCAL_RANK: str(index), env.RANK: str(nproc * node_rank + index)})
        env.export({"FORK_LAUNCHED": "1"})
        self.launcher(*args)


def _refuse(what: str) -> NoReturn:
    raise NotImplementedError(
        f"{what} builds the processes' environment from `accelerate launch`'s parsed arguments; hasten's launcher "
        "builds its own: run the script with `hasten launch` (Accelerate's flags: --num_processes, "
        "--mixed_precision, --use_fsdp, ...), or from Python with hasten.notebook_launcher / debug_launcher"
    )


def prepare_multi_gpu_env(args: argparse.Namespace) -> NoReturn:
    """Refused: ``hasten launch`` builds the environment of a multi-process run."""
    _refuse("prepare_multi_gpu_env")


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> NoReturn:
    """Refused: ``hasten launch`` builds the command and environment of a run."""
    _refuse("prepare_simple_launcher_cmd_env")
