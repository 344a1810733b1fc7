"""Seeding and the random number generator states that a checkpoint saves and restores.

The states are those a training step draws from: Python's ``random``, NumPy's global
generator (when NumPy is installed), torch's CPU generator and the generator of every
CUDA device. ``capture_rng_state`` returns them in a form ``torch.load(weights_only=True)``
accepts; ``restore_rng_state`` puts them back and raises when it cannot restore one
exactly (a resume that silently reseeds dropout is not a resume).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hasten import _validate as v
from hasten.settings import environment as env

_MAX_SEED = 2**32 - 1  # NumPy's global generator takes seeds in [0, 2**32)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _process_index() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env.env_rank()


def set_seed(seed: int, device_specific: bool = False) -> int:
    """Seed Python's ``random``, NumPy (if installed), torch and every CUDA device.

    With ``device_specific=True`` each process adds its rank to ``seed`` (so ranks draw
    different numbers, e.g. for data augmentation). Returns the seed used in this process.
    """
    v.check_number("set_seed", "seed", seed, integer=True, ge=0, le=_MAX_SEED)
    v.check_bool("set_seed", "device_specific", device_specific)
    if device_specific:
        seed += _process_index()
        if seed > _MAX_SEED:
            raise ValueError(
                f"set_seed.seed + process index must be <= {_MAX_SEED} with device_specific=True, got {seed}"
            )
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily when CUDA is not initialised yet)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, as plain lists and tensors."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss": gauss}}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state: Any, where: str = "the checkpoint") -> None:
    """Raise if ``restore_rng_state(state)`` could not restore every state exactly; change nothing."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise RuntimeError(f"cannot restore RNG states: {where} holds no RNG states (got {type(state).__name__})")
    np = _numpy()
    if np is not None and "numpy" not in state:
        raise RuntimeError(
            f"cannot restore RNG states: NumPy is installed here but {where} holds no NumPy state "
            "(it was saved without NumPy); the resumed run would not draw the same numbers"
        )
    if np is None and "numpy" in state:
        raise RuntimeError(f"cannot restore RNG states: {where} holds a NumPy state but NumPy is not installed here")
    saved_cuda = state.get("cuda")
    have_cuda = _cuda_device_count()
    if len(saved_cuda or ()) != have_cuda:
        raise RuntimeError(
            f"cannot restore RNG states: {where} holds states for {len(saved_cuda or ())} CUDA device(s) "
            f"but this process sees {have_cuda}; resume on the same kind of machine"
        )
    try:
        py = state["python"]
        random.Random().setstate((py["version"], tuple(py["state"]), py["gauss"]))  # a scratch generator
        if np is not None:
            n = state["numpy"]
            keys = np.asarray(n["keys"], dtype=np.uint32)
            np.random.RandomState().set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
        torch.Generator().set_state(state["torch"].cpu())
        for s in saved_cuda or ():
            if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8:
                raise TypeError(f"a CUDA generator state must be a uint8 tensor, got {type(s).__name__}")
    except Exception as error:
        raise RuntimeError(f"cannot restore RNG states from {where}: {type(error).__name__}: {error}") from error


def restore_rng_state(state: Any, where: str = "the checkpoint") -> None:
    """Put back the states of ``capture_rng_state``; any state that cannot be restored is an error,
    raised before any generator changed."""
    check_rng_state(state, where)
    np = _numpy()
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if np is not None:
        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda"):
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


_RNG_TYPES = ("torch", "cuda", "generator")


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Give every process the main process's random states (Accelerate's function).

    ``rng_types``: any of "torch" (the CPU generator), "cuda" (the current CUDA device's) and
    "generator" (``generator``, required then). Other device types (XLA, NPU...) are refused.
    A no-op without a process group.
    """
    import torch.distributed as dist

    if isinstance(rng_types, str):
        rng_types = [rng_types]
    for rng_type in rng_types:
        name = v.check_choice(
            "synchronize_rng_states", "rng_types", str(getattr(rng_type, "value", rng_type)), _RNG_TYPES
        )
        if name == "generator" and not isinstance(generator, torch.Generator):
            raise ValueError(
                f"synchronize_rng_states(['generator']) needs generator=torch.Generator(), got {generator!r}"
            )
        if name == "cuda" and not torch.cuda.is_available():
            continue
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            continue
        state = {"torch": torch.get_rng_state, "cuda": torch.cuda.get_rng_state}.get(
            name, lambda: generator.get_state()
        )()
        shared = [state if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        if name == "torch":
            torch.set_rng_state(shared[0])
        elif name == "cuda":
            torch.cuda.set_rng_state(shared[0])
        else:
            generator.set_state(shared[0])
