"""The file names (and the forms of three files) of hasten's own layouts: Accelerate's, or hasten's first ones.

Checkpoints of the "full" layout are written with the names and file forms of Hugging Face
Accelerate's ``save_state`` (``ACCELERATE``), so that Accelerate's ``Accelerator.load_state``
resumes a folder hasten wrote (one process, or DDP resumed at its number of processes)::

    model.safetensors, model_1.safetensors ...   (pytorch_model.bin, pytorch_model_1.bin ... without
                                                  safe_serialization): the model's own keys
    optimizer.bin, optimizer_1.bin ...           scheduler.bin, scheduler_1.bin ...
    custom_checkpoint_0.pkl ...                  scaler.pt (the GradScaler's state dict itself)
    random_states_0.pkl ...                      per process: Accelerate's dict of RNG states
                                                  ("random_state", "numpy_random_seed",
                                                  "torch_manual_seed", "torch_cuda_manual_seed" and
                                                  "step", its accumulation counter) and hasten's own
                                                  state of the process under "hasten" (its rank, seed and
                                                  dataloader positions), which Accelerate ignores

Each file is written once, with that name: there is no second copy in hasten's own names. The
manifest, its checksums and the atomic commit are as before, and ``loop_state.json`` and the
manifest are files Accelerate does not read. The manifest's ``file_names`` says which names a
checkpoint has: "accelerate", or "hasten" (the "dcp" layout's, whose models and optimizers are
sharded folders Accelerate cannot read; and every checkpoint written before the field existed)::

    model_0.safetensors (model_0.bin), optimizer_0.pt, scheduler_0.pt, custom_0.pt,
    scaler.pt ({"scaler": the GradScaler's state}), rank_0.pt ({"rank", "rng", "seed", "dataloaders"})

Readers get a per-process file as hasten's ``rank_N.pt`` dict whatever the names
(``FileNames.read_rank``), so everything after reading is the same for both.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

#: the manifest's field naming the file names, and its value where absent (checkpoints of earlier versions)
FIELD = "file_names"
DEFAULT = "hasten"
#: the loop counters' file of every hasten layout (a name Accelerate never writes)
LOOP_STATE = "loop_state.json"


def numbered(stem: str, ext: str, i: int) -> str:
    """Accelerate's numbering: ``stem.ext`` for the first object, ``stem_1.ext`` ... for the others."""
    return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"


class FileNames:
    """hasten's first names (``rank_N.pt`` and ``{kind}_{i}.pt``); ``ACCELERATE`` subclasses it."""

    name = "hasten"

    def model(self, i: int, safe: bool) -> str:
        return f"model_{i}.safetensors" if safe else f"model_{i}.bin"

    def optimizer(self, i: int) -> str:
        return f"optimizer_{i}.pt"

    def scheduler(self, i: int) -> str:
        return f"scheduler_{i}.pt"

    def custom(self, i: int) -> str:
        return f"custom_{i}.pt"

    def rank(self, i: int) -> str:
        return f"rank_{i}.pt"

    def is_rank(self, file_name: str) -> bool:
        """Whether ``file_name`` is a per-process file (a process reads its own, and rank 0's)."""
        return re.fullmatch(r"rank_\d+\.pt", file_name) is not None

    def scaler_state(self, precision_state: dict[str, Any]) -> Any:
        """What ``scaler.pt`` holds, from ``Precision.state_dict()``."""
        return precision_state

    def read_scaler(self, saved: Any) -> Any:
        """``Precision.load_state_dict``'s argument, from what ``scaler.pt`` holds."""
        return saved

    def rank_state(self, state: dict[str, Any], micro_step: int) -> dict[str, Any]:
        """What a process's file holds, from hasten's ``{"rank", "rng", "seed", "dataloaders"}``."""
        return state

    def read_rank(self, load: Any, i: int, where: str) -> Any:
        """Process ``i``'s file (read with ``load``, ``restore.torch_files``'s reader) as hasten's dict."""
        return load(self.rank(i))


class AccelerateNames(FileNames):
    """Accelerate's ``save_state`` names and forms (``checkpointing.save_accelerator_state``)."""

    name = "accelerate"

    def model(self, i: int, safe: bool) -> str:
        return numbered("model", ".safetensors", i) if safe else numbered("pytorch_model", ".bin", i)

    def optimizer(self, i: int) -> str:
        return numbered("optimizer", ".bin", i)

    def scheduler(self, i: int) -> str:
        return numbered("scheduler", ".bin", i)

    def custom(self, i: int) -> str:
        return f"custom_checkpoint_{i}.pkl"

    def rank(self, i: int) -> str:
        return f"random_states_{i}.pkl"

    def is_rank(self, file_name: str) -> bool:
        return RNG_FILE.fullmatch(file_name) is not None

    def scaler_state(self, precision_state: dict[str, Any]) -> Any:
        return precision_state["scaler"]

    def read_scaler(self, saved: Any) -> Any:
        return {"scaler": saved}

    def rank_state(self, state: dict[str, Any], micro_step: int) -> dict[str, Any]:
        """Accelerate's dict of RNG states, its "step" (the accumulation counter: the micro-step,
        whose remainder by the accumulation steps is all Accelerate reads of it) and hasten's part."""
        out = as_accelerate_rng(state["rng"])
        out["step"] = int(micro_step)
        out["hasten"] = {k: state[k] for k in ("rank", "seed", "dataloaders")}
        return out

    def read_rank(self, load: Any, i: int, where: str) -> Any:
        file_name = self.rank(i)
        saved = read_rng_file(load, file_name, where)
        own = saved.get("hasten") if isinstance(saved, dict) else None
        if not isinstance(own, dict):
            raise ValueError(f"{where}: {file_name!r} does not hold process {i}'s state")
        return {**own, "rng": as_hasten_rng(saved, f"{where} ({file_name})")}


HASTEN = FileNames()
ACCELERATE = AccelerateNames()
_BY_NAME = {n.name: n for n in (HASTEN, ACCELERATE)}
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")


def names_of(manifest: dict[str, Any], where: str) -> FileNames:
    """The file names of a checkpoint, by its manifest's ``file_names`` (absent: hasten's first ones)."""
    value = manifest.get(FIELD, DEFAULT)
    if not isinstance(value, str) or value not in _BY_NAME:
        raise ValueError(
            f"load_state: the manifest of {where} is damaged: {FIELD} is {value!r}; it must be one of "
            f"{', '.join(repr(n) for n in sorted(_BY_NAME))}"
        )
    return _BY_NAME[value]


def hasten_wrote(directory: str) -> bool:
    """Whether the local folder ``directory`` holds files of a hasten save: its ``loop_state.json``
    (a name Accelerate never writes; written before the per-process files, by both executors), or a
    ``random_states_0.pkl`` with hasten's part. Without its manifest such a folder is a save that did
    not finish, which must not pass for an Accelerate checkpoint."""
    if os.path.exists(os.path.join(directory, LOOP_STATE)):
        return True
    try:
        with torch.serialization.safe_globals(rng_types()):
            saved = torch.load(os.path.join(directory, ACCELERATE.rank(0)), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable here: Accelerate's reader says why, naming the file
        return False
    return isinstance(saved, dict) and "hasten" in saved


# ---------------------------------------------------------------------- RNG states in Accelerate's form


def rng_types() -> list[Any]:
    """The NumPy globals an Accelerate RNG file holds (an array of uint32 and its dtype)."""
    import codecs

    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    types: list[Any] = [np.ndarray, np.dtype, codecs.encode]
    # The reconstructor under both of its module names (files written with NumPy 1 or 2).
    types += [
        (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    ]
    if hasattr(np, "dtypes"):
        types.append(np.dtypes.UInt32DType)
    return types


def read_rng_file(load: Any, file_name: str, where: str) -> Any:
    """Accelerate's random-state file ``file_name``, with the NumPy types it needs allowed."""
    try:
        allow = rng_types()
    except ImportError:
        raise ValueError(
            f"{where}: {file_name!r} holds NumPy's random state, but NumPy is not installed here"
        ) from None
    return load(file_name, allow)


def as_accelerate_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """hasten's RNG states (``training.rng.capture_rng_state``) in the form of Accelerate's file."""
    py = rng["python"]
    out: dict[str, Any] = {
        "random_state": (py["version"], tuple(py["state"]), py["gauss"]),
        "torch_manual_seed": rng["torch"],
    }
    if "numpy" in rng:
        import numpy as np

        n = rng["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        out["numpy_random_seed"] = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
    if rng.get("cuda") is not None:
        out["torch_cuda_manual_seed"] = list(rng["cuda"])
    return out


def as_hasten_rng(states: Any, where: str) -> dict[str, Any]:
    """Accelerate's RNG file, in the form ``hasten.training.rng.restore_rng_state`` takes."""
    if not isinstance(states, dict) or "random_state" not in states or "torch_manual_seed" not in states:
        raise ValueError(f"{where} holds no random states")
    try:
        version, internal, gauss = states["random_state"]
        out: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "torch": states["torch_manual_seed"],
        }
        if "numpy_random_seed" in states:
            kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
            out["numpy"] = {
                "kind": str(kind),
                "keys": [int(k) for k in keys],
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if "torch_cuda_manual_seed" in states:
            out["cuda"] = list(states["torch_cuda_manual_seed"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the random states are not in Accelerate's form ({e})") from e
    return out
