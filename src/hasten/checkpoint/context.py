"""What checkpoints read and restore: one Accelerator's parts, passed explicitly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hasten.distributed import ops

if TYPE_CHECKING:  # pragma: no cover
    from hasten.distributed.state import LoopState, RunState
    from hasten.settings.plugins import ProjectConfiguration
    from hasten.strategies import Strategy
    from hasten.training.precision import Precision
    from hasten.training.registry import PreparedObjects


@dataclass(frozen=True)
class CheckpointInfo:
    """The checkpoint last saved or loaded by an Accelerator (``accelerator.checkpoint_state``)."""

    directory: str
    iteration: int | None  # N of an automatically named checkpoint_N, else None


@dataclass
class Checkpointable:
    """The parts of an Accelerator that ``save_state``/``load_state`` save and restore.

    Built once by the Accelerator (its ``Checkpointer`` holds it); every field is an object the
    Accelerator keeps, so what is prepared later is seen here too.
    """

    state: RunState
    registry: PreparedObjects
    strategy: Strategy
    precision: Precision
    gradient_state: LoopState
    project: ProjectConfiguration
    save_hooks: dict[int, Callable[..., None]] = field(default_factory=dict)
    load_hooks: dict[int, Callable[..., None]] = field(default_factory=dict)
    #: FaultToleranceKwargs' torchft state (strategies/fault_tolerance.py's FaultTolerance): saved and restored
    fault_tolerance: Any = None

    @property
    def step(self) -> int:
        return self.registry.sync_steps()

    def writes_here(self) -> bool:
        """Whether this process writes the files of ``save``/``save_model`` (one per machine with save_on_each_node)."""
        return self.state.is_local_main_process if self.project.save_on_each_node else self.state.is_main_process

    def check_single_node(self, call: str) -> None:
        state = self.state
        if self.project.save_on_each_node and state.num_processes > state.num_local_processes:
            raise ValueError(
                f"{call}() with ProjectConfiguration(save_on_each_node=True) on "
                f"{state.num_processes // state.num_local_processes} machines is not supported: hasten's checkpoints "
                "are written atomically into one directory that every process sees (a shared filesystem); "
                "set save_on_each_node=False (save() and save_model() do honour it)"
            )

    def agree(self, what: str, fn: Callable[[], Any], share: bool = False, group: Any = None) -> Any:
        """``fn`` on every process, failing everywhere if it failed anywhere (see ``ops.agree``;
        ``group``: the process group to agree over, the default one where None)."""
        return ops.agree(self.state.process_index, what, fn, share, group)

    def from_main(self, value: Any) -> Any:
        return ops.from_main(self.state.is_main_process, value)
