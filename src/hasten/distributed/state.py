"""Process facts (rank, world size, device), the process group and the training loop's position.

The process group is the only global state hasten keeps, because torch.distributed keeps
it global. ``init_distributed`` is a plain function that is safe to call twice;
``ProcessState`` is a cheap view of the launcher's environment plus that group (an
Accelerator's, ``RunState``, adds the mixed precision); ``LoopState`` is one Accelerator's
position in its loop. hasten passes these objects explicitly. Accelerate's global-state classes
(``PartialState``, ``AcceleratorState``, ``GradientState``) live in ``hasten.compat.state``,
which the runtime never imports; this module names them for ``accelerate.state``'s path and
keeps the record of states made that they read (see the end of the module).
Consumes ``InitProcessGroupKwargs``. The timeout that group was made with is the run's
(``hasten.settings.groups.group_timeout``): every group hasten makes gets it (``init_mesh``,
``flatten_mesh`` there), and hasten's waits for its own background work are bounded by it.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hasten.distributed import processes
from hasten.settings import environment as env
from hasten.settings.choices import StrEnum
from hasten.settings.handlers import InitProcessGroupKwargs


class DistributedType(StrEnum):
    """How the current process takes part in training.

    The members are Accelerate's, so ``state.distributed_type == DistributedType.XLA`` works in
    any script; hasten itself runs as NO, MULTI_CPU or MULTI_GPU, so comparisons with the other
    members are simply False.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


_atexit_registered = False


def _destroy_at_exit() -> None:
    """Destroy the group at exit (an atexit handler); a failure is reported on stderr, not hidden.

    Under ``hasten launch`` this runs in the worker's ordered exit (``hasten.cli._child``), while
    the interpreter is whole, and the process then ends with ``os._exit``. The group is not freed
    here when a DDP model still holds it (torch keeps it from C++ even after the model is gone),
    so its gloo threads live until the process ends: that is why the worker skips the
    interpreter's teardown rather than rely on this handler.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - reported, and the other atexit handlers still run
            rank = env.get(env.RANK, "?")
            sys.stderr.write(
                f"[rank{rank}] hasten: destroying the process group at exit failed: {type(exc).__name__}: {exc}\n"
            )
            sys.stderr.flush()


def _store_of_this_attempt(world_size: int, timeout: Any) -> dist.Store | None:
    """The launcher's store under a prefix naming this restart attempt, on one machine (else None).

    torch.distributed.run's workers share the agent's store across restarts of the worker
    group (``--max_restarts``), so a restarted worker would read what the failed attempt left
    there (gloo's peer addresses) and connect to dead processes: the restart fails or hangs.
    With one agent, every worker sees the same TORCHELASTIC_RESTART_COUNT, which names the attempt.
    """
    if env.get(env.TORCHELASTIC_USE_AGENT_STORE) != "True" or env.get(env.GROUP_WORLD_SIZE) != "1":
        return None
    store = dist.TCPStore(
        env.require(env.MASTER_ADDR), int(env.require(env.MASTER_PORT)), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"hasten/attempt_{env.get(env.TORCHELASTIC_RESTART_COUNT, '0')}", store)


def init_distributed(handler: InitProcessGroupKwargs | None, device: torch.device, world_size: int, rank: int) -> bool:
    """Initialise the default process group once; return False if it already existed.

    The group is destroyed at interpreter exit so processes end cleanly.
    """
    global _atexit_registered
    if dist.is_initialized():
        return False
    handler = handler or InitProcessGroupKwargs()
    kwargs = handler.process_group_kwargs(device.type)
    if "init_method" not in kwargs:
        missing = [name for name in (env.MASTER_ADDR, env.MASTER_PORT) if not env.get(name)]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} asks for a distributed run, but {', '.join(missing)} "
                "is not set: start the script with `hasten launch` or `torchrun`, or pass "
                "InitProcessGroupKwargs(init_method=...)"
            )
        store = _store_of_this_attempt(world_size, kwargs["timeout"])
        if store is not None:
            kwargs["store"] = store
    if device.type == "cuda":
        kwargs.setdefault("device_id", device)
    dist.init_process_group(world_size=world_size, rank=rank, **kwargs)
    if not _atexit_registered:
        atexit.register(_destroy_at_exit)
        _atexit_registered = True
    return True


# --------------------------------------------------------------------------- the run's timeout


def timeout_error(what: str, timeout: timedelta) -> TimeoutError:
    """The error of a wait that ran past the run's timeout (``what`` names what was waited for)."""
    return TimeoutError(
        f"{what} did not finish within the {timeout.total_seconds():g} s timeout (InitProcessGroupKwargs.timeout): "
        "another process has probably stopped or died (the launcher names the rank that failed first); "
        "if the work is only slow, give Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=...)]) a longer one"
    )


def _device_from_environment() -> torch.device | None:
    """``HASTEN_TORCH_DEVICE`` (or Accelerate's ``ACCELERATE_TORCH_DEVICE``): this process's device, e.g. ``cuda:1``."""
    for name in (env.HASTEN_TORCH_DEVICE, env.ACCELERATE_TORCH_DEVICE):
        raw = env.get(name)
        if raw:
            try:
                device = torch.device(raw)
            except RuntimeError:
                device = None
            if device is None or device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"environment variable {name}={raw!r} must name a 'cpu' or 'cuda' device, e.g. 'cuda:1' "
                    "(hasten runs on CPUs and CUDA GPUs)"
                )
            return device
    return None


def _choose_device(cpu: bool, local_rank: int) -> torch.device:
    if not cpu:
        device = _device_from_environment()
        if device is not None:
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            return device
    if cpu or env.env_flag(env.HASTEN_USE_CPU) or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class ProcessState:
    """Where this process stands: rank, world size, device, process group.

    Reads what ``torch.distributed.run`` (and so ``hasten launch``) sets: RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT. When WORLD_SIZE > 1 the
    default process group is initialised (once per process) with ``init_handler``.
    Accelerate's ``PartialState`` (``hasten.compat.state``) is this class with Accelerate's
    shared-state behaviour added.
    """

    def __init__(self, cpu: bool = False, init_handler: InitProcessGroupKwargs | None = None) -> None:
        self.num_processes = env.env_int(env.WORLD_SIZE, 1)
        self.process_index = env.env_int(env.RANK, 0)
        self.local_process_index = env.env_int(env.LOCAL_RANK, 0)
        self.num_local_processes = env.env_int(
            env.LOCAL_WORLD_SIZE, 1 if self.num_processes == 1 else self.num_processes
        )
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"RANK={self.process_index} must be in [0, WORLD_SIZE={self.num_processes})")
        self.device = _choose_device(cpu, self.local_process_index)
        if dist.is_available() and dist.is_initialized():
            # A group made elsewhere (an earlier Accelerator, or the user) wins over the environment.
            warn_if_group_differs(init_handler)
            self.num_processes = dist.get_world_size()
            self.process_index = dist.get_rank()
        elif self.num_processes > 1:
            init_distributed(init_handler, self.device, self.num_processes, self.process_index)
        if self.use_distributed:
            self.backend: str | None = dist.get_backend()
            self.distributed_type = (
                DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU
            )
        else:
            self.backend = None
            self.distributed_type = DistributedType.NO
        _record(self, cpu)

    # ------------------------------------------------------------------ facts
    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def initialized(self) -> bool:
        return True

    @property
    def debug(self) -> bool:
        """Debug mode: collectives check first that every process passes alike shapes (see ops.py).

        Process-wide, as in Accelerate, where every PartialState shares it.
        """
        from hasten.distributed.ops import debug_mode

        return debug_mode()

    @debug.setter
    def debug(self, flag: bool) -> None:
        from hasten.distributed.ops import set_debug

        set_debug(flag)

    @property
    def default_device(self) -> torch.device:
        return self.device

    def wait_for_everyone(self) -> None:
        if self.use_distributed:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group`` (default: the default group) if it exists; safe to call twice."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to download or cache), then the others."""
        yield from processes.goes_first(self, self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from processes.goes_first(self, self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor or dict of them."""
        yield processes.split_between_processes(inputs, self.num_processes, self.process_index, apply_padding)

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on the main process only (others get None)."""
        return processes.run_on(function, self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        return processes.run_on(function, self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return processes.run_on(function, self.is_last_process or not self.use_distributed)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return processes.on_process(self, function, process_index, "process_index")

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        return processes.on_process(self, function, local_process_index, "local_process_index", local=True)

    # The name Accelerate gives this object, in its repr and in the error for an attribute it lacks
    # (``'AcceleratorState' object has no attribute 'x'``), as before the classes moved to compat.
    shown_as: ClassVar[str] = "PartialState"

    def __getattr__(self, name: str) -> Any:  # only for attributes not found normally
        if self.__dict__.get("_was_reset") and name in _RESET_FACTS:
            # As Accelerate's shared states: once a new state exists, a reset one reads its facts.
            successor = _current.get("state") if isinstance(self, RunState) else _latest[0]
            if successor is not None and not successor.__dict__.get("_was_reset"):
                return getattr(successor, name)
            raise AttributeError(
                f"`{self.shown_as}` object has no attribute `{name}`. This happens if "
                f"`{self.shown_as}._reset_state()` was called and an `Accelerator` or `PartialState` was not "
                "reinitialized: create a new one"
            )
        raise AttributeError(f"'{self.shown_as}' object has no attribute '{name}'")

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's ``PartialState._reset_state()`` (for tests and notebooks): every existing
        process state that is not an Accelerator's forgets its facts, so code still using one reads
        the state made after it or fails saying why; create a new one."""
        reset_states(accelerators=False)

    def __repr__(self) -> str:
        if self.__dict__.get("_was_reset"):
            return f"{self.shown_as}(reset)"
        return (
            f"{self.shown_as}(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, local_process_index={self.local_process_index}, "
            f"device={self.device}, backend={self.backend})"
        )


def warn_if_group_differs(handler: InitProcessGroupKwargs | None) -> None:
    """A second handler cannot change a group that already exists: say so instead of ignoring it."""
    if handler is not None and dist.is_available() and dist.is_initialized():
        wanted = None if handler.backend_is_auto else str(handler.backend)
        if wanted is not None and wanted != dist.get_backend():
            warnings.warn(
                f"InitProcessGroupKwargs(backend={wanted!r}) is ignored: the process group already exists "
                f"with backend {dist.get_backend()!r}",
                stacklevel=3,
            )


class RunState(ProcessState):
    """An Accelerator's own state (``accelerator.state``): the process facts plus the run's mixed
    precision, which the Accelerator sets once its Precision exists.

    Each Accelerator has its own (several may live in one process). Accelerate's
    ``AcceleratorState`` (``hasten.compat.state``) counts it as one of its instances.
    """

    shown_as: ClassVar[str] = "AcceleratorState"
    deepspeed_plugin = None
    megatron_lm_plugin = None
    #: the Accelerator's FSDP plugin (Accelerate's ``accelerator.state.fsdp_plugin``; None without FSDP)
    fsdp_plugin: Any = None
    mixed_precision: str

    @property
    def use_fp16(self) -> bool:
        return self.mixed_precision != "no"

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's ``AcceleratorState._reset_state()`` (for tests and notebooks), also as
        ``accelerator.state._reset_state()``: every existing Accelerator's state (and with
        ``reset_partial_state`` every other process state) forgets its facts; an Accelerator made
        before then fails saying so (make a new one), and Accelerate's ``AcceleratorState()`` and
        ``GradientState()`` no longer return an existing Accelerator's."""
        _current.clear()
        reset_states(accelerators=True)
        if reset_partial_state:
            reset_states(accelerators=False)

    def __repr__(self) -> str:
        if self.__dict__.get("_was_reset"):
            return super().__repr__()
        return f"{super().__repr__()[:-1]}, mixed_precision={self.mixed_precision!r})"


class LoopState:
    """The training loop's position, shared by one Accelerator's optimizers, schedulers and loaders
    (``accelerator.gradient_state``; Accelerate's ``GradientState`` counts it as one of its instances).

    ``sync_gradients`` is False on the micro-steps of gradient accumulation where gradients
    are only accumulated locally; ``end_of_dataloader`` is True while the last batch of a
    prepared dataloader is in use (which forces a sync, unless ``sync_with_dataloader`` is
    False); ``remainder`` is, while that last batch is in use, how many of the samples of the
    last global batch (all processes together) are real when it is short: ``gather_for_metrics``
    keeps that many and drops the rest (padding of a short batch, samples that sharding repeated
    to even out the processes); 0 when the batch is full. ``active_dataloader`` is the prepared
    dataloader being iterated (the inner one of nested loops; None outside), as in Accelerate;
    each loop hands the outer one its own ``end_of_dataloader``/``remainder`` back when it ends.
    The accumulation settings come from ``GradientAccumulationPlugin``.
    """

    shown_as: ClassVar[str] = "GradientState"  # as ProcessState.shown_as

    __slots__ = (
        "num_steps",
        "sync_gradients",
        "end_of_dataloader",
        "remainder",
        "micro_step",
        "sync_with_dataloader",
        "sync_each_batch",
        "_loaders",
        "__weakref__",
    )

    def __init__(
        self,
        num_steps: int | None = None,
        *,
        sync_with_dataloader: bool = True,
        sync_each_batch: bool = False,
        gradient_accumulation_plugin: Any = None,
    ) -> None:
        if gradient_accumulation_plugin is not None:
            num_steps = gradient_accumulation_plugin.num_steps
            sync_with_dataloader = gradient_accumulation_plugin.sync_with_dataloader
            sync_each_batch = gradient_accumulation_plugin.sync_each_batch
        self.num_steps = 1 if num_steps is None else num_steps
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.remainder = 0
        self.micro_step = 0
        # The prepared dataloaders being iterated, innermost last (weak: a loader left alive by
        # nobody else is freed, and so is its iterator).
        self._loaders: list[weakref.ref] = []

    def __getattr__(self, name: str) -> Any:  # only for attributes not found normally
        raise AttributeError(f"'{self.shown_as}' object has no attribute '{name}'")

    def __reduce__(self) -> tuple:
        # Pickled as its own object, made without calling the class (Accelerate's
        # ``GradientState()`` returns the current Accelerator's); the loaders being iterated are
        # not part of it.
        state = {name: getattr(self, name) for name in _LOOP_FIELDS}
        return (_blank, (type(self),), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._loaders = []

    @property
    def initialized(self) -> bool:
        return True

    # Accelerate's view of the loop: which prepared dataloader is being iterated.
    @property
    def dataloader_references(self) -> list[Any]:
        """``[None]`` followed by the prepared dataloaders being iterated, innermost last (as Accelerate)."""
        return [None, *(loader for loader in (ref() for ref in self._loaders) if loader is not None)]

    @property
    def active_dataloader(self) -> Any:
        """The prepared dataloader being iterated (the innermost of nested loops), None outside any loop."""
        for ref in reversed(self._loaders):
            loader = ref()
            if loader is not None:
                return loader
        return None

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    # Accelerate's private names that transformers' Trainer uses (it decides the sync itself).
    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The accumulation settings as Accelerate's ``GradientAccumulationPlugin.to_kwargs()``
        gives them: ``num_steps`` and the others that differ from their defaults."""
        kwargs: dict[str, Any] = {"num_steps": self.num_steps}
        if not self.sync_with_dataloader:
            kwargs["sync_with_dataloader"] = False
        if self.sync_each_batch:
            kwargs["sync_each_batch"] = True
        return kwargs

    def _add_dataloader(self, dataloader: Any) -> None:
        """A prepared dataloader starts an iteration (called by the loader)."""
        self._loaders.append(weakref.ref(dataloader))

    def _remove_dataloader(self, dataloader: Any) -> None:
        """A prepared dataloader's iteration ended or was left (called by the loader)."""
        for i in range(len(self._loaders) - 1, -1, -1):
            if self._loaders[i]() is dataloader:
                del self._loaders[i]
                return

    def advance(self) -> bool:
        """Count one micro-step and decide whether it synchronises gradients."""
        self.micro_step += 1
        self.sync_gradients = (
            self.end_of_dataloader and self.sync_with_dataloader
        ) or self.micro_step % self.num_steps == 0
        if self.sync_gradients:
            self.micro_step = 0
        return self.sync_gradients


_LOOP_FIELDS = (
    "num_steps",
    "sync_gradients",
    "end_of_dataloader",
    "remainder",
    "micro_step",
    "sync_with_dataloader",
    "sync_each_batch",
)


def _blank(cls: type) -> Any:
    return object.__new__(cls)


# --------------------------------------------------------------------------- the record of states made
# hasten's runtime hands its states to whatever needs them and never reads this record; it writes
# it once per state and once per Accelerator made. Accelerate's scripts ask for "the" state instead
# (``AcceleratorState()``, ``GradientState()``, ``PartialState._shared_state``, ``_reset_state()``):
# Accelerate's global-state emulation, ``hasten.compat.state``, answers from here, so the runtime
# never imports it, and it also sees the states made before it was imported.

# Every state alive (what ``_reset_state()`` empties).
_made: weakref.WeakSet[ProcessState] = weakref.WeakSet()
# The most recently made state (kept alive: what a reset one reads).
_latest: list[ProcessState | None] = [None]
# The facts of the states made, the latest's over the earlier ones', with its ``cpu`` argument as
# "_cpu" (Accelerate's ``PartialState._shared_state``).
_facts: dict[str, Any] = {}
# The most recently made Accelerator's "state" and (weakly: an Accelerator nobody holds any more
# is freed with it) its loop state, "gradient".
_current: dict[str, Any] = {}


def _record(state: ProcessState, cpu: bool) -> None:
    _made.add(state)
    _latest[0] = state
    _facts.update(state.__dict__, _cpu=cpu)


# What a reset state no longer knows (reading one of these explains the reset).
_RESET_FACTS = frozenset(
    {
        "num_processes",
        "process_index",
        "local_process_index",
        "num_local_processes",
        "device",
        "backend",
        "distributed_type",
        "mixed_precision",
        "use_distributed",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "default_device",
    }
)


def reset_states(accelerators: bool) -> None:
    """Empty every existing Accelerator's state (``accelerators``) or every other process state
    (and the shared facts): each forgets its facts, and a read of one goes to the state made after
    it or explains the reset (``ProcessState.__getattr__``)."""
    if not accelerators:
        _facts.clear()
    for state in list(_made):
        if isinstance(state, RunState) == accelerators:
            state.__dict__.clear()
            state.__dict__["_was_reset"] = True
            _made.discard(state)


def current_run() -> RunState | None:
    """The state of the most recently made Accelerator (None before any)."""
    return _current.get("state")


def set_current(state: RunState, gradient: LoopState) -> None:
    """Called by each new Accelerator: it is now the one Accelerate's ``AcceleratorState()`` and
    ``GradientState()`` return the states of."""
    _current["state"] = state
    _current["gradient"] = weakref.ref(gradient)
